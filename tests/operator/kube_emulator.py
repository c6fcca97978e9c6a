"""A Kubernetes API server for tests: kmock's emulator plus the API-server behaviours an operator relies on.

No API server can run on the project's machines (ARCHITECTURE §7). kmock's `KubernetesEmulator` serves
discovery, list/watch/get/create/patch/delete from memory but treats objects as plain JSON. An operator
depends on more than that, so `FidelityKubernetesEmulator` adds, as the real API server does:

- `metadata.uid`, `creationTimestamp`, a cluster-wide increasing `resourceVersion` on every write
  (a no-op patch writes nothing), and `generation`, bumped only when something outside `metadata` and
  `status` changes;
- the status subresource: for resources that declare it, `status` is dropped on create, ignored in
  patches of the main resource, and the only thing `PATCH .../status` changes;
- merge patches (`null` deletes), JSON patches with `test` operations (a failed test is 422, which is
  how kopf's optimistic concurrency on finalizers works), and `metadata.resourceVersion` preconditions
  (409 on mismatch);
- deletion with finalizers (`deletionTimestamp`, then removal once the last finalizer goes), and
  background garbage collection of dependents through `ownerReferences` (`propagationPolicy: Orphan`
  keeps them);
- `labelSelector` (equality, inequality, set-based and existence terms) and `metadata.name` field
  selectors on lists;
- for registered CustomResourceDefinitions: defaulting and pruning by the structural schema, validation
  against it (422 naming every bad field; unknown fields rejected, 400, only with `fieldValidation=Strict`,
  like the real server), and the CEL transition rule `self == oldSelf` (immutable fields). Other CEL
  rules raise at registration rather than pass silently. tests/operator/test_crd_server.py checks these
  case by case against the real apiextensions-apiserver.

Writes (create, patch, delete) are answered by the emulator itself (kmock reactions do not intercept them);
reads go through kmock as usual, so tests can still script replies with its DSL.

Not emulated: strategic merge (treated as a JSON merge patch), server-side apply, admission webhooks,
defaults of built-in kinds, foreground deletion (treated as background), watch bookmarks.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonschema
import kmock
from kmock._internal import enums, rendering

from agentgym.lifecycle import merge_patch

JSONDict = dict[str, Any]

_MERGE_TYPES = {"application/merge-patch+json", "application/strategic-merge-patch+json", "application/json"}
_JSON_PATCH_TYPE = "application/json-patch+json"


class KubernetesInvalidError(kmock.KubernetesError):
    """422: the object fails validation; `details.causes` name each field."""


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, reason: str, message: str, causes: list[JSONDict] | None = None) -> kmock.KubernetesError:
    details: JSONDict = {"causes": causes} if causes else {}
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


def _without(obj: Mapping[str, Any], *keys: str) -> JSONDict:
    return {k: v for k, v in obj.items() if k not in keys}


# ---------------------------------------------------------------------------------------------------------------------
# Label selectors
# ---------------------------------------------------------------------------------------------------------------------

_SET_TERM = re.compile(r"^\s*(?P<key>[^\s!=]+)\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)\s*$")


def _split_selector(selector: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, char in enumerate(selector):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            yield selector[start:i]
            start = i + 1
    yield selector[start:]


def matches_label_selector(labels: Mapping[str, str], selector: str) -> bool:
    """Kubernetes label-selector semantics for the string form (`a=b,c!=d,e in (f,g),!h,i`)."""
    for raw in _split_selector(selector):
        term = raw.strip()
        if not term:
            continue
        if match := _SET_TERM.match(term):
            values = {v.strip() for v in match["values"].split(",") if v.strip()}
            present = match["key"] in labels
            if match["op"] == "in" and not (present and labels[match["key"]] in values):
                return False
            if match["op"] == "notin" and present and labels[match["key"]] in values:
                return False
        elif "!=" in term:
            key, value = (part.strip() for part in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (part.strip() for part in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------------
# CustomResourceDefinition schemas
# ---------------------------------------------------------------------------------------------------------------------


def openapi_to_jsonschema(node: Any) -> Any:
    """Kubernetes' OpenAPI v3 subset -> JSON Schema draft 4 (nullable -> null type, x- keys dropped)."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    out = {
        key: (
            {name: openapi_to_jsonschema(prop) for name, prop in value.items()}
            if key == "properties"
            else openapi_to_jsonschema(value)
        )
        for key, value in node.items()
        if not key.startswith("x-kubernetes") and key != "default"
    }
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@attrs.frozen
class CustomResourceSchema:
    """What the emulator enforces for one served version of a CRD."""

    schema: JSONDict
    immutable: tuple[tuple[tuple[str, ...], str], ...]  # (path from the object root, message)

    @classmethod
    def from_openapi(cls, openapi: JSONDict) -> CustomResourceSchema:
        immutable: list[tuple[tuple[str, ...], str]] = []

        def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
            for rule in node.get("x-kubernetes-validations", []):
                if rule.get("rule", "").replace(" ", "") != "self==oldSelf":
                    raise NotImplementedError(f"CEL rule {rule.get('rule')!r} at {'.'.join(path)} is not emulated")
                immutable.append((path, rule.get("message") or "Value is immutable"))
            for name, prop in node.get("properties", {}).items():
                walk(prop, (*path, name))
            if isinstance(node.get("items"), Mapping):
                walk(node["items"], (*path, "[]"))

        walk(openapi, ())
        return cls(schema=openapi, immutable=tuple(immutable))

    def default(self, obj: Any, node: Mapping[str, Any] | None = None) -> Any:
        """Structural defaulting: fill absent properties that have a `default`, recursively."""
        node = self.schema if node is None else node
        if isinstance(obj, dict):
            for name, prop in node.get("properties", {}).items():
                if name not in obj and "default" in prop:
                    obj[name] = copy.deepcopy(prop["default"])
                if name in obj:
                    obj[name] = self.default(obj[name], prop)
            extra = node.get("additionalProperties")
            if isinstance(extra, Mapping):
                for key in obj:
                    obj[key] = self.default(obj[key], extra)
        elif isinstance(obj, list) and isinstance(node.get("items"), Mapping):
            return [self.default(item, node["items"]) for item in obj]
        return obj

    def unknown_fields(self, obj: Any, node: Mapping[str, Any] | None = None, path: str = "") -> list[str]:
        """Paths of fields the structural schema does not know (what the server prunes)."""
        node = self.schema if node is None else node
        found: list[str] = []
        if node.get("x-kubernetes-preserve-unknown-fields") or path in ("metadata",):
            return found
        if isinstance(obj, dict) and "properties" in node:
            for key, value in obj.items():
                sub = f"{path}.{key}" if path else key
                if key in node["properties"]:
                    found += self.unknown_fields(value, node["properties"][key], sub)
                elif not path and key in ("apiVersion", "kind", "metadata"):
                    continue
                else:
                    found.append(sub)
        elif isinstance(obj, list) and isinstance(node.get("items"), Mapping):
            for i, item in enumerate(obj):
                found += self.unknown_fields(item, node["items"], f"{path}[{i}]")
        return found

    def prune(self, obj: JSONDict, paths: list[str]) -> None:
        for path in paths:
            parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
            target: Any = obj
            for part in parts[:-1]:
                target = target[int(part[1:-1])] if part.startswith("[") else target[part]
            target.pop(parts[-1], None)

    def validate(self, obj: JSONDict) -> list[JSONDict]:
        """422 causes (`field`, `message`) for every schema violation."""
        validator = jsonschema.Draft4Validator(openapi_to_jsonschema(self.schema))
        causes = []
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            parts = list(error.absolute_path)
            reason, message = "FieldValueInvalid", error.message
            if error.validator == "required":  # the real server names the missing field itself
                parts.append(re.findall(r"'([^']+)' is a required property", error.message)[0])
                reason, message = "FieldValueRequired", "Required value"
            field = ""
            for part in parts:
                field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
            causes.append({"reason": reason, "field": field or "(root)", "message": message})
        return causes

    def transition_errors(self, old: JSONDict, new: JSONDict) -> list[JSONDict]:
        """Violations of `self == oldSelf` rules (evaluated only where both old and new hold the field)."""
        causes = []
        for path, message in self.immutable:
            if "[]" in path:
                raise NotImplementedError("transition rules inside lists are not emulated")
            old_value, new_value, present = old, new, True
            for part in path:
                if not (isinstance(old_value, Mapping) and isinstance(new_value, Mapping)):
                    present = False
                    break
                if part not in old_value or part not in new_value:
                    present = False
                    break
                old_value, new_value = old_value[part], new_value[part]
            if present and old_value != new_value:
                causes.append({"reason": "FieldValueInvalid", "field": ".".join(path), "message": message})
        return causes


def resource_of(crd: Mapping[str, Any], version: str | None = None) -> kmock.resource:
    spec = crd["spec"]
    served = [v for v in spec["versions"] if v.get("served", True)]
    chosen = next(v for v in served if version is None or v["name"] == version)
    return kmock.resource(spec["group"], chosen["name"], spec["names"]["plural"])


# ---------------------------------------------------------------------------------------------------------------------
# The emulator
# ---------------------------------------------------------------------------------------------------------------------


@attrs.define(kw_only=True)
class FidelityKubernetesEmulator(kmock.KubernetesEmulator):
    """`kmock.KubernetesEmulator` with resourceVersion/generation/status-subresource/finalizer/GC fidelity.

    async with FidelityKubernetesEmulator() as api, kmock.Server(api):
        api.resources.load_bundled()             # built-in kinds (discovery)
        api.register_crd(crd_document())        # a CRD: discovery, schema, immutability
    """

    _resource_version: int = attrs.field(default=0, init=False)
    _orphans: set[str] = attrs.field(factory=set, init=False)
    _journal: list[tuple[int, kmock.resource, JSONDict]] = attrs.field(factory=list, init=False)
    _watchers: list[tuple[kmock.resource, asyncio.Queue[JSONDict]]] = attrs.field(factory=list, init=False)
    _schemas: dict[kmock.resource, CustomResourceSchema] = attrs.field(factory=dict, init=False)

    def register_crd(self, crd: Mapping[str, Any]) -> None:
        """Serve a CustomResourceDefinition: discovery info, status subresource, schema and CEL rules."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
                subresources=set(version.get("subresources", {})),
            )
            openapi = version.get("schema", {}).get("openAPIV3Schema")
            if openapi:
                self._schemas[resource] = CustomResourceSchema.from_openapi(openapi)

    # -- helpers ------------------------------------------------------------------------------------------------------

    def _next_version(self) -> str:
        self._resource_version += 1
        return str(self._resource_version)

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _live(self, key: tuple[kmock.resource, str | None, str]) -> JSONDict | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _check_custom(self, request: rendering.Request, obj: JSONDict, old: JSONDict | None) -> None:
        assert request.resource is not None
        schema = self._schemas.get(request.resource)
        if schema is None:
            return
        schema.default(obj)
        unknown = schema.unknown_fields(obj)
        if unknown and request.params.get("fieldValidation") == "Strict":
            # As the real server: refused while decoding (400, no causes), before any validation.
            kind = self.resources[request.resource].kind if request.resource in self.resources else "object"
            version = request.resource.version
            fields = ", ".join(f'unknown field "{path}"' for path in unknown)
            message = f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}'
            raise _error(400, "BadRequest", message)
        schema.prune(obj, unknown)
        causes = schema.validate(obj)
        if old is not None:
            causes += schema.transition_errors(old, obj)
        if causes:
            raise self._invalid(request, obj, causes)

    def _invalid(self, request: rendering.Request, obj: JSONDict, causes: list[JSONDict]) -> kmock.KubernetesError:
        assert request.resource is not None
        kind = self.resources[request.resource].kind if request.resource in self.resources else "object"
        name = obj.get("metadata", {}).get("name", "")
        summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
        return _error(422, "Invalid", f'{kind} "{name}" is invalid: {summary}', causes)

    # -- writes -------------------------------------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        is_put = request.method == enums.method.PUT and request.name is not None
        if request.resource is None or (request.action not in _WRITES and not is_put):
            return await super()._handle(request)

        finished: tuple[kmock.resource, str | None, str] | None = None
        async with self._lock:
            if request.action == enums.action.CREATE:
                events = self._create(request)
                status = 201
            elif request.action == enums.action.DELETE:
                events, finished = self._delete(request)
                status = 200
            else:
                events, finished = self._update(request, replace=is_put)
                status = 200
            self._emit(events)
            result = self._response_object(request, events)
            if finished is not None:
                self._emit(self._remove(finished))
        return aiohttp.web.json_response(result, status=status)

    def _response_object(self, request: rendering.Request, events: list[tuple[kmock.resource, JSONDict]]) -> JSONDict:
        """What a write returns: the object as stored (for a no-op write, the unchanged object)."""
        if events:
            return copy.deepcopy(events[0][1]["object"])
        assert request.resource is not None
        live = self._live((request.resource, request.namespace, request.name or ""))
        if live is None:
            raise _error(404, "NotFound", f"{request.resource.plural} {request.name!r} not found")
        return live

    def _emit(self, events: list[tuple[kmock.resource, JSONDict]]) -> None:
        """Journal the events (for watches resuming from a resourceVersion) and feed the live watches."""
        for resource, event in events:
            event = copy.deepcopy(event)
            self._journal.append((self._resource_version, resource, event))
            for watched, queue in self._watchers:
                if watched == resource:
                    queue.put_nowait(event)

    def _create(self, request: rendering.Request) -> list[tuple[kmock.resource, JSONDict]]:
        assert request.resource is not None
        if not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(dict(request.data))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise self._invalid(request, obj, [{"field": "metadata.name", "message": "Required value"}])
        namespace = request.namespace or meta.get("namespace")
        if namespace is not None:
            meta["namespace"] = namespace
        key = (request.resource, namespace, meta["name"])
        if self._live(key) is not None:
            raise _error(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
        if self._has_status_subresource(request.resource):
            obj.pop("status", None)
        self._check_custom(request, obj, None)
        meta.pop("deletionTimestamp", None)
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            generation=1,
            resourceVersion=self._next_version(),
        )
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        return [(request.resource, {"type": "ADDED", "object": obj})]

    def _update(
        self, request: rendering.Request, *, replace: bool
    ) -> tuple[list[tuple[kmock.resource, JSONDict]], tuple[kmock.resource, str | None, str] | None]:
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        old = self._live(key)
        if old is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')

        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = request.data
        if replace:
            if not isinstance(body, Mapping):
                raise _error(400, "BadRequest", "the body must be a JSON object")
            precondition = body.get("metadata", {}).get("resourceVersion") or None
            new = copy.deepcopy(dict(body))
        elif content_type == _JSON_PATCH_TYPE:
            if not isinstance(body, list):
                raise _error(400, "BadRequest", "a JSON patch must be a list of operations")
            precondition = None
            try:
                new = jsonpatch.apply_patch(old, body, in_place=False)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise _error(422, "Invalid", f"the request is invalid: {exc}") from None
            except (jsonpatch.JsonPatchConflict, jsonpatch.InvalidJsonPatch) as exc:
                raise _error(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from None
        elif content_type in _MERGE_TYPES:
            if not isinstance(body, Mapping):
                raise _error(400, "BadRequest", "a merge patch must be a JSON object")
            precondition = (
                body.get("metadata", {}).get("resourceVersion") if isinstance(body.get("metadata"), Mapping) else None
            )
            new = merge_patch(old, body)
        else:
            raise _error(415, "UnsupportedMediaType", f"the patch type {content_type!r} is not supported")

        if precondition is not None and str(precondition) != old["metadata"]["resourceVersion"]:
            raise _error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": '
                "the object has been modified; please apply your changes to the latest version and try again",
            )

        # What each endpoint may change: the status subresource only status, the main resource all but status.
        if request.subresource == "status":
            new = {**old, "status": new.get("status")} if new.get("status") is not None else _without(old, "status")
        elif request.subresource is not None:
            raise _error(404, "NotFound", f"subresource {request.subresource!r} is not emulated")
        elif self._has_status_subresource(request.resource):
            new = {**_without(new, "status"), **({"status": old["status"]} if "status" in old else {})}

        # Fields the server owns.
        new_meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "name", "namespace"):
            if field in old["metadata"]:
                new_meta[field] = old["metadata"][field]
            else:
                new_meta.pop(field, None)
        if old["metadata"].get("deletionTimestamp"):
            added = set(new_meta.get("finalizers", [])) - set(old["metadata"].get("finalizers", []))
            if added:
                raise _error(422, "Invalid", f"no new finalizers can be added if the object is being deleted: {added}")
        new_meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        self._check_custom(request, new, old)

        if new == old:
            return [], None  # a no-op write stores nothing and notifies nobody
        if _without(new, "metadata", "status") != _without(old, "metadata", "status"):
            new_meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new_meta["resourceVersion"] = self._next_version()
        self._objects[key].create(new)  # a new version in the history
        events = [(request.resource, {"type": "MODIFIED", "object": new})]
        finished = key if new_meta.get("deletionTimestamp") and not new_meta.get("finalizers") else None
        return events, finished

    def _delete(
        self, request: rendering.Request
    ) -> tuple[list[tuple[kmock.resource, JSONDict]], tuple[kmock.resource, str | None, str] | None]:
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        obj = self._live(key)
        if obj is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        options = request.data if isinstance(request.data, Mapping) else {}
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy") or "Background"
        if policy == "Orphan":
            self._orphans.add(obj["metadata"]["uid"])
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return [], None
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["resourceVersion"] = self._next_version()
            self._objects[key].create(obj)
            return [(request.resource, {"type": "MODIFIED", "object": obj})], None
        return [], key

    def _remove(self, key: tuple[kmock.resource, str | None, str]) -> list[tuple[kmock.resource, JSONDict]]:
        """Remove an object for good and garbage-collect its dependents (background propagation)."""
        obj = self._live(key)
        if obj is None:
            return []
        self._objects[key].delete()
        obj["metadata"]["resourceVersion"] = self._next_version()
        events = [(key[0], {"type": "DELETED", "object": obj})]
        uid = obj["metadata"]["uid"]
        if uid in self._orphans:
            return events
        for dependent_key in list(self._objects.keys()):
            dependent = self._live(dependent_key)
            if dependent is None:
                continue
            refs = dependent["metadata"].get("ownerReferences", [])
            if not any(ref.get("uid") == uid for ref in refs):
                continue
            if dependent["metadata"].get("finalizers"):
                if not dependent["metadata"].get("deletionTimestamp"):
                    dependent["metadata"]["deletionTimestamp"] = _now()
                    dependent["metadata"]["resourceVersion"] = self._next_version()
                    self._objects[dependent_key].create(dependent)
                    events.append((dependent_key[0], {"type": "MODIFIED", "object": dependent}))
            else:
                events += self._remove(dependent_key)
        return events

    # -- reads ------------------------------------------------------------------------------------------------------

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        """A watch that starts where `resourceVersion` says, with no gap between the snapshot and live events."""
        yield b""  # send the headers now
        assert request.resource is not None
        queue: asyncio.Queue[JSONDict] = asyncio.Queue()
        since = request.params.get("resourceVersion")
        async with self._lock:
            if since in (None, "", "0"):
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                    for (resource, _, _), obj in self._objects.items()
                    if resource == request.resource and not obj.deleted
                ]
            else:
                backlog = [copy.deepcopy(e) for v, r, e in self._journal if r == request.resource and v > int(since)]
            entry = (request.resource, queue)
            self._watchers.append(entry)
        try:
            for event in backlog:
                if self._watch_matches(request, event):
                    yield event
            while True:
                event = await queue.get()
                if self._watch_matches(request, event):
                    yield event
        finally:
            self._watchers.remove(entry)

    def _watch_matches(self, request: rendering.Request, event: JSONDict) -> bool:
        meta = event["object"].get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        selector = request.params.get("labelSelector")
        return not selector or matches_label_selector(meta.get("labels", {}), selector)

    # -- lists --------------------------------------------------------------------------------------------------------

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        listing: Any = await super()._serve_list(request)
        items = listing["items"]
        if selector := request.params.get("labelSelector"):
            items = [i for i in items if matches_label_selector(i.get("metadata", {}).get("labels", {}), selector)]
        if fields := request.params.get("fieldSelector"):
            for term in fields.split(","):
                field, _, value = term.partition("=")
                if field.strip() != "metadata.name":
                    raise _error(400, "BadRequest", f"field selector {field!r} is not emulated")
                items = [i for i in items if i.get("metadata", {}).get("name") == value.strip().lstrip("=")]
        return {**listing, "items": items, "metadata": {"resourceVersion": str(self._resource_version)}}


_WRITES = {enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE}
