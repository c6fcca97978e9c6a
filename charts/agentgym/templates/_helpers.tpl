{{/* Names, labels and the values shared by several templates. */}}

{{- define "agentgym.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains "agentgym" .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-agentgym" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "agentgym.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: agentgym
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentgym
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "operator") */}}
{{- define "agentgym.selectorLabels" -}}
app.kubernetes.io/name: agentgym
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* An agentgym image: (dict "ctx" $ "repository" "agentgym/operator") -> registry/repository:tag.
     A full reference (with a tag or digest, e.g. what `skaffold dev` sets) is used as it is. */}}
{{- define "agentgym.image" -}}
{{- $images := .ctx.Values.images -}}
{{- $tag := $images.tag | default .ctx.Chart.AppVersion -}}
{{- if or (contains "@" .repository) (contains ":" (.repository | splitList "/" | last)) -}}
{{- .repository -}}
{{- else if $images.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $images.registry) .repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The watched namespaces (the release namespace by default). */}}
{{- define "agentgym.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toJson (uniq .Values.operator.watchNamespaces) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* The NATS chart's fullname (its own rule), for the service URL and the NetworkPolicy. */}}
{{- define "agentgym.natsFullname" -}}
{{- if .Values.nats.fullnameOverride -}}
{{- .Values.nats.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default "nats" .Values.nats.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "agentgym.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s.%s.svc:4222" (include "agentgym.natsFullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "messaging.external.url is required when nats.enabled=false" .Values.messaging.external.url -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding NATS credentials (keys user+password, or token); empty when there is none. */}}
{{- define "agentgym.natsAuthSecret" -}}
{{- if .Values.nats.enabled -}}
{{- printf "%s-nats-auth" .Release.Name -}}
{{- else -}}
{{- .Values.messaging.external.credentialsSecret -}}
{{- end -}}
{{- end -}}

{{/* NATS credentials as container env (optional keys: user/password or token). */}}
{{- define "agentgym.natsEnv" -}}
{{- $secret := include "agentgym.natsAuthSecret" . -}}
{{- if $secret }}
{{- range $variable, $key := dict "NATS_USER" "user" "NATS_PASSWORD" "password" "NATS_TOKEN" "token" }}
- name: {{ $variable }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end }}
{{- end -}}

{{- define "agentgym.otlpEndpoint" -}}
{{- if .Values.otel.collector.enabled -}}
{{- printf "http://%s-otel-collector.%s.svc:4318" (include "agentgym.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.otel.endpoint -}}
{{- end -}}
{{- end -}}

{{- define "agentgym.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "agentgym.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "agentgym.imagePullSecrets" -}}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- /* Peers "in the platform": pods labelled by the chart or the operator, in the release namespace and
       the watched namespaces (any namespace when cluster-wide). */ -}}
{{- define "agentgym.platformNamespaces" -}}
{{- if .Values.operator.clusterWide }}
namespaceSelector: {}
{{- else }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: In
      values: {{ append (include "agentgym.watchNamespaces" . | fromJsonArray) .Release.Namespace | uniq | toJson }}
{{- end }}
{{- end -}}
