{{- define "radixserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "radixserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "radixserve.instanceLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The server pods; the helm test pod has component "test", so the Service never selects it. */}}
{{- define "radixserve.selectorLabels" -}}
{{ include "radixserve.instanceLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "radixserve.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "radixserve.labels" -}}
{{ include "radixserve.metaLabels" . }}
{{ include "radixserve.selectorLabels" . }}
{{- end }}

{{- define "radixserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Where the model lies inside the containers: the value of --model. */}}
{{- define "radixserve.modelPath" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "embedded" }}embedded
{{- else if eq $m.source "huggingface" }}
{{- printf "/models/%s" (required "model.huggingface.repoId is required" $m.huggingface.repoId) }}
{{- else }}
{{- printf "/models/%s" $m.path | trimSuffix "/" }}
{{- end }}
{{- end }}

{{- define "radixserve.servedModelName" -}}
{{- $m := .Values.model }}
{{- if $m.servedModelName }}{{ $m.servedModelName }}
{{- else if eq $m.source "embedded" }}embedded
{{- else if eq $m.source "huggingface" }}{{ $m.huggingface.repoId }}
{{- else }}{{ $m.path | default (include "radixserve.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The flags all three processes get, identical by construction: the ZMQ ports must agree,
and the tokenizer and detokenizer load the same tokenizer as the worker's model.
*/}}
{{- define "radixserve.args" -}}
{{- $e := .Values.engine }}
{{- $p := .Values.ports -}}
- --model={{ include "radixserve.modelPath" . }}
- --served-model-name={{ include "radixserve.servedModelName" . }}
- --host=0.0.0.0
- --port={{ $p.http }}
- --worker-metrics-port={{ $p.workerMetrics }}
- --detokenizer-metrics-port={{ $p.detokenizerMetrics }}
- --worker-port={{ $p.zmq.worker }}
- --detokenizer-port={{ $p.zmq.detokenizer }}
- --tokenizer-port={{ $p.zmq.tokenizer }}
- --tokenizer-control-port={{ $p.zmq.tokenizerControl }}
- --schedule-policy={{ $e.schedulePolicy }}
- --schedule-conservativeness={{ $e.scheduleConservativeness }}
- --chunked-prefill-size={{ if $e.chunkedPrefillSize }}{{ int64 $e.chunkedPrefillSize }}{{ else }}none{{ end }}
- --radix-eviction-policy={{ $e.radixEvictionPolicy }}
{{- if $e.disableRadixCache }}
- --disable-radix-cache
{{- end }}
{{- if $e.maxTotalTokens }}
- --max-total-tokens={{ int64 $e.maxTotalTokens }}
{{- end }}
- --mem-fraction-static={{ $e.memFractionStatic }}
- --max-running-requests={{ int64 $e.maxRunningRequests }}
{{- if $e.contextLength }}
- --context-length={{ int64 $e.contextLength }}
{{- end }}
{{- if kindIs "bool" $e.disableOverlapSchedule }}
- {{ ternary "--disable-overlap-schedule" "--no-disable-overlap-schedule" $e.disableOverlapSchedule }}
{{- end }}
- --grammar-backend={{ $e.grammarBackend }}
- --dtype={{ $e.dtype }}
- --max-tokens-cap={{ int64 $e.maxTokensCap }}
- --heartbeat-interval={{ $e.heartbeatInterval }}
- --graceful-shutdown-timeout={{ .Values.gracefulShutdown.streamDrainSeconds }}
- --log-level={{ $e.logLevel }}
{{- range $e.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The seconds the worker and detokenizer wait in preStop: the tokenizer's whole drain. */}}
{{- define "radixserve.drainSeconds" -}}
{{- $g := .Values.gracefulShutdown }}
{{- add $g.endpointDelaySeconds $g.streamDrainSeconds }}
{{- end }}

{{/* Mounts every container needs: the writable paths of a read-only root, and the model. */}}
{{- define "radixserve.volumeMounts" -}}
- name: home
  mountPath: /home/radixserve
- name: cache
  mountPath: /var/cache/radixserve
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.model.source "embedded" }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
{{- end }}
