{{/*
The pod of the Deployment, and of the LeaderWorkerSet's two templates (multinode.enabled).
Called with the root context merged with podRole:
- "server": the three containers, the pod the Service, the probes and the router address;
- "rank": a node of a multi-node group beyond the first: the worker container alone, which
  starts that node's tensor-parallel ranks and follows rank 0 on the leader. It serves no
  API and no /healthz, so it has no ports and no probes; a rank that fails exits, and the
  LeaderWorkerSet recreates the group. It keeps the worker's preStop wait: rank 0 drains
  only while every rank still answers its collectives.
*/}}
{{- define "radixserve.podTemplate" -}}
{{- $m := .Values.model }}
{{- $g := .Values.gracefulShutdown }}
{{- $server := eq .podRole "server" -}}
metadata:
  labels:
    {{- if $server }}
    {{- include "radixserve.labels" . | nindent 4 }}
    # The llm-d router picks the metric names of an endpoint by this label (engineConfigs).
    llm-d.ai/engine-type: radixserve
    {{- else }}
    {{- include "radixserve.metaLabels" . | nindent 4 }}
    {{- include "radixserve.instanceLabels" . | nindent 4 }}
    # Not "server": the Service, the PDB, the autoscalers and the InferencePool never select
    # a pod that serves no API.
    app.kubernetes.io/component: rank
    {{- end }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  # Kubernetes would set <SERVICE>_PORT=tcp://… variables, and a Service named
  # "radixserve" turns that into RADIXSERVE_PORT, which radixserve reads as --port.
  enableServiceLinks: false
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ add (include "radixserve.drainSeconds" . | int) $g.exitSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or (not .Values.wire.keysSecret) (eq $m.source "huggingface") }}
  initContainers:
  {{- end }}
    {{- if not .Values.wire.keysSecret }}
    # Fresh CURVE keys of the ZMQ wire for this pod's life, in memory only.
    - name: wire-keys
      image: {{ include "radixserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: [radixserve, keys, {{ include "radixserve.wireKeysDir" . | quote }}]
      env:
        - name: NVIDIA_VISIBLE_DEVICES
          value: void
      resources:
        requests: {cpu: 10m, memory: 32Mi}
        limits: {memory: 256Mi}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: wire-keys
          mountPath: /etc/radixserve/wire
    {{- end }}
  {{- if eq $m.source "huggingface" }}
    # Downloads with the engine's own file patterns; files already there are kept, so a
    # PVC is filled once.
    - name: download-model
      image: {{ include "radixserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - python
        - -c
        - |
          import sys
          from huggingface_hub import snapshot_download
          from engine.model.loader import HUB_ALLOW_PATTERNS, HUB_IGNORE_PATTERNS
          repo_id, revision, local_dir = sys.argv[1:]
          snapshot_download(repo_id, revision=revision, local_dir=local_dir,
                            allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS)
        - {{ $m.huggingface.repoId | quote }}
        - {{ $m.huggingface.revision | quote }}
        - {{ include "radixserve.modelPath" . | quote }}
      env:
        - name: NVIDIA_VISIBLE_DEVICES
          value: void
        {{- with $m.huggingface.tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $m.huggingface.tokenSecret.key }}
        {{- end }}
      # A download needs what the tokenizer needs: a little CPU, a little memory.
      resources:
        {{- toYaml .Values.tokenizer.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: home
          mountPath: /home/radixserve
        - name: cache
          mountPath: /var/cache/radixserve
        - name: tmp
          mountPath: /tmp
        - name: model
          mountPath: /models
  {{- end }}
  containers:
    {{- if $server }}
    - name: tokenizer
      image: {{ include "radixserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: [python, -m, services.tokenizer]
      args:
        {{- include "radixserve.args" . | nindent 8 }}
      env:
        - name: NVIDIA_VISIBLE_DEVICES
          value: void
        {{- with .Values.apiKeySecret.name }}
        - name: RADIXSERVE_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.apiKeySecret.key }}
        {{- end }}
        {{- with .Values.auth.adminKeySecret.name }}
        - name: RADIXSERVE_ADMIN_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.auth.adminKeySecret.key }}
        {{- end }}
        {{- with include "radixserve.env" (dict "root" . "env" .Values.tokenizer.env) }}
        {{- . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ .Values.ports.http }}
      startupProbe:
        {{- toYaml .Values.tokenizer.startupProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml .Values.tokenizer.livenessProbe | nindent 8 }}
      readinessProbe:
        {{- toYaml .Values.tokenizer.readinessProbe | nindent 8 }}
      lifecycle:
        preStop:
          exec:
            command: [sleep, {{ $g.endpointDelaySeconds | quote }}]
      resources:
        {{- toYaml .Values.tokenizer.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "radixserve.volumeMounts" . | nindent 8 }}
    {{- end }}
    - name: worker
      image: {{ include "radixserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: [python, -m, services.worker]
      args:
        {{- include "radixserve.args" . | nindent 8 }}
      {{- with include "radixserve.env" (dict "root" . "env" .Values.worker.env) }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      {{- if $server }}
      ports:
        # /healthz for the probes; its /metrics are served again by the tokenizer's.
        - name: worker-metrics
          containerPort: {{ .Values.ports.workerMetrics }}
        {{- if .Values.kvEvents.enabled }}
        - name: kv-events
          containerPort: {{ .Values.kvEvents.port }}
        {{- with .Values.kvEvents.replayPort }}
        - name: kv-replay
          containerPort: {{ . }}
        {{- end }}
        {{- end }}
      startupProbe:
        {{- toYaml .Values.worker.startupProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml .Values.worker.livenessProbe | nindent 8 }}
      {{- end }}
      lifecycle:
        preStop:
          exec:
            command: [sleep, {{ include "radixserve.drainSeconds" . | quote }}]
      resources:
        {{- $resources := deepCopy .Values.worker.resources }}
        {{- if .Values.worker.gpus }}
        {{- $limits := merge (dict "nvidia.com/gpu" .Values.worker.gpus) ($resources.limits | default dict) }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "radixserve.volumeMounts" . | nindent 8 }}
    {{- if $server }}
    - name: detokenizer
      image: {{ include "radixserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: [python, -m, services.detokenizer]
      args:
        {{- include "radixserve.args" . | nindent 8 }}
      env:
        - name: NVIDIA_VISIBLE_DEVICES
          value: void
        {{- with include "radixserve.env" (dict "root" . "env" .Values.detokenizer.env) }}
        {{- . | nindent 8 }}
        {{- end }}
      ports:
        - name: detok-metrics
          containerPort: {{ .Values.ports.detokenizerMetrics }}
      startupProbe:
        {{- toYaml .Values.detokenizer.startupProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml .Values.detokenizer.livenessProbe | nindent 8 }}
      lifecycle:
        preStop:
          exec:
            command: [sleep, {{ include "radixserve.drainSeconds" . | quote }}]
      resources:
        {{- toYaml .Values.detokenizer.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "radixserve.volumeMounts" . | nindent 8 }}
    {{- end }}
  volumes:
    - name: wire-keys
      {{- with .Values.wire.keysSecret }}
      secret:
        secretName: {{ . }}
        # Owner and group (fsGroup) only: the processes refuse keys others can read.
        defaultMode: 0440
      {{- else }}
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
      {{- end }}
    {{- with .Values.auth.apiKeysSecret.name }}
    - name: api-keys
      secret:
        secretName: {{ . }}
        defaultMode: 0440
    {{- end }}
    - name: home
      emptyDir:
        sizeLimit: {{ .Values.writableVolumes.sizeLimit }}
    - name: cache
      emptyDir:
        sizeLimit: {{ .Values.writableVolumes.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.writableVolumes.sizeLimit }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.shm.sizeLimit }}
    {{- if eq $m.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ include "radixserve.modelClaimName" . | required "model.pvc.claimName (or model.pvc.create) is required when model.source is pvc" }}
        readOnly: true
    {{- else if eq $m.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    {{- else if eq $m.source "huggingface" }}
    - name: model
      {{- with include "radixserve.modelClaimName" . }}
      persistentVolumeClaim:
        claimName: {{ . }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $m.huggingface.sizeLimit }}
      {{- end }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
