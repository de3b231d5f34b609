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
{{- $tpSize := include "radixserve.tpSize" . | int }}
{{- if gt $tpSize 1 }}
- --tp-size={{ $tpSize }}
{{- end }}
{{- if .Values.multinode.enabled }}
{{- /* The kubelet expands $(VAR) from the container's environment, where the
LeaderWorkerSet puts each pod's place in its group (the leader's index is 0). */}}
- --nnodes=$(LWS_GROUP_SIZE)
- --node-rank=$(LWS_WORKER_INDEX)
- --dist-init-addr=$(LWS_LEADER_ADDRESS):{{ int64 .Values.multinode.distInitPort }}
{{- end }}
- --max-tokens-cap={{ int64 $e.maxTokensCap }}
- --heartbeat-interval={{ $e.heartbeatInterval }}
- --graceful-shutdown-timeout={{ .Values.gracefulShutdown.streamDrainSeconds }}
- --ipc-keys-dir={{ include "radixserve.wireKeysDir" . }}
{{- with .Values.auth.apiKeysSecret.name }}
- --api-key-file={{ printf "/etc/radixserve/auth/%s" $.Values.auth.apiKeysSecret.key }}
{{- end }}
- --log-level={{ $e.logLevel }}
{{- if .Values.kvEvents.enabled }}
- {{ printf "--kv-events-config=%s" (include "radixserve.kvEventsConfig" .) | toJson }}
- --kv-events-block-size={{ int64 .Values.kvEvents.blockSize }}
{{- end }}
{{- include "radixserve.loraArgs" . }}
{{- range $e.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- /* LoRA flags: adapters and their root are paths inside the model volume (/models). */}}
{{- define "radixserve.loraArgs" -}}
{{- $l := .Values.lora }}
{{- if or $l.adapters $l.runtimeUpdate }}
{{- if eq .Values.model.source "embedded" }}
{{- fail "lora adapters are read from the model volume: set model.source to pvc, hostPath or huggingface" }}
{{- end }}
{{- $paths := list }}
{{- range $l.adapters }}
{{- $paths = append $paths (printf "%s=/models/%s" .name (trimPrefix "/" .path)) }}
{{- end }}
{{- if $paths }}
- --lora-paths={{ join "," $paths }}
{{- end }}
- --max-loras-per-batch={{ int64 $l.maxLorasPerBatch }}
- --max-lora-rank={{ int64 $l.maxLoraRank }}
{{- if $l.runtimeUpdate }}
- --enable-lora-runtime-update
{{- end }}
{{- with $l.root }}
- --lora-root={{ printf "/models/%s" (trimPrefix "/" .) | trimSuffix "/" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The LeaderWorkerSet: not the Service's name, which its controller would take for the headless
Service it makes under that name and through which the pods find their leader
(LWS_LEADER_ADDRESS). Short enough for its pods' host names, <name>-<group>-<index>.
*/}}
{{- define "radixserve.groupName" -}}
{{- printf "%s-group" (include "radixserve.fullname" . | trunc 40 | trimSuffix "-") }}
{{- end }}

{{/* Ranks of one model: a rank per GPU (one on the CPU) on each node of the group. */}}
{{- define "radixserve.tpSize" -}}
{{- $nodes := ternary (int .Values.multinode.nodes) 1 .Values.multinode.enabled }}
{{- mul (max 1 (int .Values.worker.gpus)) $nodes }}
{{- end }}

{{/* What an autoscaler scales: the Deployment, or the LeaderWorkerSet's groups (its scale
subresource counts groups and selects their leaders). */}}
{{- define "radixserve.scaleTargetRef" -}}
{{- if .Values.multinode.enabled -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
name: {{ include "radixserve.groupName" . }}
{{- else -}}
apiVersion: apps/v1
kind: Deployment
name: {{ include "radixserve.fullname" . }}
{{- end }}
{{- end }}

{{/*
The names of the server pods, as a Prometheus regex: a Deployment's are
<fullname>-<replicaset hash>-<suffix>; a LeaderWorkerSet's leaders are <name>-<group>
(its other pods, <name>-<group>-<index>, serve no metrics).
*/}}
{{- define "radixserve.serverPodPattern" -}}
{{- if .Values.multinode.enabled }}{{ printf "%s-[0-9]+" (include "radixserve.groupName" .) }}
{{- else }}{{ printf "%s-[a-z0-9]+-[a-z0-9]+" (include "radixserve.fullname" .) }}
{{- end }}
{{- end }}

{{/*
--kv-events-config: SGLang's and vLLM's JSON keys. The topic names the pod as the router
addresses it (pod IP and API port, $(POD_IP) expanded by the kubelet) and the model as
clients name it, which is how the llm-d router attributes the events.
*/}}
{{- define "radixserve.kvEventsConfig" -}}
{{- $k := .Values.kvEvents }}
{{- $topic := $k.topic | default (printf "kv@$(POD_IP):%d@%s" (int64 .Values.ports.http) (include "radixserve.servedModelName" .)) }}
{{- $config := dict "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int64 $k.port)) "topic" $topic "buffer_steps" (int64 $k.bufferSteps) "hwm" (int64 $k.hwm) }}
{{- if $k.replayPort }}
{{- $_ := set $config "replay_endpoint" (printf "tcp://*:%d" (int64 $k.replayPort)) }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/*
The environment of one server container: what the chart sets, then extraEnv, then the
container's own `env`. Called with (dict "root" $ "env" <the container's env>).
*/}}
{{- define "radixserve.env" -}}
{{- $v := .root.Values }}
{{- $env := list }}
{{- if $v.kvEvents.enabled }}
{{- $env = append $env (dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) }}
{{- end }}
{{- with concat $env ($v.extraEnv | default list) (.env | default list) }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* The model's claim, existing or created; "" when the model is on no claim. */}}
{{- define "radixserve.modelClaimName" -}}
{{- $m := .Values.model }}
{{- $created := ternary ($m.pvc.claimName | default (printf "%s-model" (include "radixserve.fullname" .))) "" $m.pvc.create }}
{{- if eq $m.source "pvc" }}{{ $m.pvc.claimName | default $created }}
{{- else if eq $m.source "huggingface" }}{{ $m.huggingface.claimName | default $created }}
{{- end }}
{{- end }}

{{/* The seconds the worker and detokenizer wait in preStop: the tokenizer's whole drain. */}}
{{- define "radixserve.drainSeconds" -}}
{{- $g := .Values.gracefulShutdown }}
{{- add $g.endpointDelaySeconds $g.streamDrainSeconds }}
{{- end }}

{{/*
The wire keys (--ipc-keys-dir): the Secret's files at the mount's root, or the subdirectory
that the init container makes private (0700) inside the emptyDir (whose root it cannot chmod).
*/}}
{{- define "radixserve.wireKeysDir" -}}
{{- if .Values.wire.keysSecret }}/etc/radixserve/wire{{ else }}/etc/radixserve/wire/keys{{ end }}
{{- end }}

{{/* Mounts every container needs: the writable paths of a read-only root, the wire keys
(read-only), the API key file, and the model. */}}
{{- define "radixserve.volumeMounts" -}}
- name: wire-keys
  mountPath: /etc/radixserve/wire
  readOnly: true
{{- if .Values.auth.apiKeysSecret.name }}
- name: api-keys
  mountPath: /etc/radixserve/auth
  readOnly: true
{{- end }}
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
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The ingress rule between the pods of the release's LeaderWorkerSet: rank 0's rendezvous port
(multinode.distInitPort) and the ports NCCL and gloo then open between ranks, which are
ephemeral and so cannot be listed. No other pod reaches them.
*/}}
{{- define "radixserve.groupIngress" -}}
- from:
    - podSelector:
        matchLabels:
          leaderworkerset.sigs.k8s.io/name: {{ include "radixserve.groupName" . }}
{{- end }}
