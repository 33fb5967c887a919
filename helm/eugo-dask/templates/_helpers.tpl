{{- define "eugo-dask.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* An object's name: <fullname>-<suffix>, at most 63 characters (the API server refuses
     longer names; a 53-character release name is allowed). Too long, the fullname is cut and a
     hash of the whole name keeps names apart: <cut fullname>-<hash>-<suffix>. (root, suffix) */}}
{{- define "eugo-dask.name" -}}
{{- $full := include "eugo-dask.fullname" .root }}
{{- $name := printf "%s-%s" $full .suffix }}
{{- if gt (len $name) 63 }}
{{- $hash := sha256sum $name | trunc 6 }}
{{- $keep := int (sub 63 (add (len .suffix) 8)) }}
{{- if gt $keep 0 }}
{{- $name = printf "%s-%s-%s" ($full | trunc $keep | trimSuffix "-") $hash .suffix }}
{{- else }}
{{- $name = printf "%s-%s" ($name | trunc 56 | trimSuffix "-") $hash }}
{{- end }}
{{- end }}
{{- $name -}}
{{- end -}}

{{/* Labels select pods by name, instance and component; each key is written once. */}}
{{- define "eugo-dask.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Object labels: the selector labels plus version and owner. (root, component) */}}
{{- define "eugo-dask.labels" -}}
{{ include "eugo-dask.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* Pod template labels: the selector labels (they win) and the pod's podLabels; no chart
     version, so a chart upgrade alone restarts nothing. (root, component, pod) */}}
{{- define "eugo-dask.podLabels" -}}
{{- toYaml (merge (include "eugo-dask.selectorLabels" . | fromYaml) (.pod.podLabels | default dict)) -}}
{{- end -}}

{{- define "eugo-dask.profileConfigMap" -}}
{{- include "eugo-dask.name" (dict "root" . "suffix" "eugo-profile") -}}
{{- end -}}

{{/* Where pods mount the profile ConfigMap (read-only), and the calibrated profile's path there. */}}
{{- define "eugo-dask.profileMount" -}}
{{- toJson (dict "name" "profile" "mountPath" "/etc/eugo" "readOnly" true) -}}
{{- end -}}

{{- define "eugo-dask.calibratedProfile" -}}
{{- printf "%s/calibrated.yaml" (include "eugo-dask.profileMount" . | fromJson).mountPath -}}
{{- end -}}

{{/* eugo.cluster-profile as the chart sets it, a JSON list ("[]": unset): the profile the
     scheduler plans with for clients that leave eugo.profile at auto, and the one the first GPU
     group's workers copy by (link.copies_by_size). The first usable entry wins, a path once
     the file exists: eugo.profile unless auto, else (with calibration.enabled) the calibrated
     profile; then the first GPU group's preset. */}}
{{- define "eugo-dask.clusterProfile" -}}
{{- $profiles := list }}
{{- if ne .Values.eugo.profile "auto" }}
{{- $profiles = append $profiles .Values.eugo.profile }}
{{- else if .Values.calibration.enabled }}
{{- $profiles = append $profiles (include "eugo-dask.calibratedProfile" .) }}
{{- end }}
{{- with (include "eugo-dask.firstGpuGroup" . | fromJson).gpu }}
{{- $profiles = append $profiles .type }}
{{- end }}
{{- toJson $profiles -}}
{{- end -}}

{{- define "eugo-dask.schedulerAddress" -}}
{{- printf "%s://%s:%v" (ternary "tls" "tcp" .Values.tls.enabled) (include "eugo-dask.name" (dict "root" . "suffix" "scheduler")) .Values.scheduler.port -}}
{{- end -}}

{{/* With tls.enabled, what a Dask process needs: the Secret and Dask's TLS config. */}}
{{- define "eugo-dask.tlsVolume" -}}
{{- if not .Values.tls.secretName }}
{{- fail "tls.secretName: tls.enabled needs a Secret with ca.crt, tls.crt and tls.key" }}
{{- end -}}
{{- toJson (dict "name" "dask-tls" "secret" (dict "secretName" .Values.tls.secretName)) -}}
{{- end -}}

{{- define "eugo-dask.tlsEnv" -}}
- {name: DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION, value: "True"}
- {name: DASK_DISTRIBUTED__COMM__TLS__CA_FILE, value: /etc/dask/tls/ca.crt}
{{- range list "SCHEDULER" "WORKER" "CLIENT" }}
- {name: DASK_DISTRIBUTED__COMM__TLS__{{ . }}__CERT, value: /etc/dask/tls/tls.crt}
- {name: DASK_DISTRIBUTED__COMM__TLS__{{ . }}__KEY, value: /etc/dask/tls/tls.key}
{{- end }}
{{- end -}}

{{/* The worker groups, each workerDefaults with the group's own keys on top, as a JSON list;
     fails on what the schema cannot see across a group and the defaults. */}}
{{- define "eugo-dask.workerGroups" -}}
{{- $groups := list }}
{{- $names := list }}
{{- range $i, $group := .Values.workerGroups }}
{{- $merged := deepCopy $.Values.workerDefaults }}
{{- range $key, $value := deepCopy $group }}
{{- $_ := set $merged $key $value }}
{{- end }}
{{- if has $group.name $names }}
{{- fail (printf "workerGroups[%d].name: %q is used by an earlier group; names must be unique" $i $group.name) }}
{{- end }}
{{- $names = append $names $group.name }}
{{- if hasKey $.Values.workerReplicas $group.name }}
{{- if $merged.autoscaling }}
{{- fail (printf "workerReplicas.%s: the group autoscales (KEDA sets its replicas from autoscaling.minReplicas to maxReplicas); change those instead" $group.name) }}
{{- end }}
{{- $_ := set $merged "replicas" (get $.Values.workerReplicas $group.name) }}
{{- end }}
{{- with $merged.autoscaling }}
{{- if not $merged.gpu }}
{{- fail (printf "workerGroups[%d] (%s).autoscaling: only GPU groups scale, on the scheduler's GPU backlog (eugo_gpu_backlog); this group has no gpu" $i $group.name) }}
{{- end }}
{{- $_ := set . "minReplicas" (ternary .minReplicas 0 (hasKey . "minReplicas")) }}
{{- $_ := set . "backlogPerReplica" (.backlogPerReplica | default 32) }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "workerGroups[%d] (%s).autoscaling: minReplicas %v is above maxReplicas %v" $i $group.name .minReplicas .maxReplicas) }}
{{- end }}
{{- /* what the helm test pod and NOTES count on */}}
{{- $_ := set $merged "replicas" .minReplicas }}
{{- end }}
{{- with $merged.gpu }}
{{- $_ := set . "count" (.count | default 1) }}
{{- $_ := set . "taskSlots" (.taskSlots | default 1) }}
{{- $_ := set . "mode" (.mode | default "worker") }}
{{- $_ := set . "resourceName" (.resourceName | default "nvidia.com/gpu") }}
{{- if eq .mode "cuda-worker" }}
{{- /* `dask cuda` is only in the eugo-dask-cuda image (tagged <tag>-cuda): a group that names
       no tag of its own gets it; one that names another image must name a cuda one */}}
{{- $image := deepCopy ($merged.image | default dict) }}
{{- if not $image.tag }}
{{- $_ := set $image "tag" (printf "%s-cuda" $.Values.image.tag) }}
{{- $_ := set $merged "image" $image }}
{{- end }}
{{- if not (contains "cuda" (printf "%s:%s" ($image.repository | default $.Values.image.repository) $image.tag)) }}
{{- fail (printf "workerGroups[%d] (%s).image: gpu.mode cuda-worker runs `dask cuda worker`, which only the eugo-dask-cuda image has (the Dockerfile's eugo-dask-cuda target, tagged <tag>-cuda); got %s:%s. Leave image.tag unset for <image.tag>-cuda, or name a cuda image" $i $group.name ($image.repository | default $.Values.image.repository) $image.tag) }}
{{- end }}
{{- end }}
{{- if and (eq .mode "cuda-worker") (ne (toString $merged.memoryLimit) "auto") }}
{{- fail (printf "workerGroups[%d] (%s).memoryLimit: dask cuda worker applies it to each of its %v GPU processes, so it must be auto (the container's memory split among them); got %q" $i $group.name .count $merged.memoryLimit) }}
{{- end }}
{{- end }}
{{- /* Dask pauses, spills and restarts a worker by its memoryLimit: above the container's
       limit the kernel kills it first (OOMKilled, every result lost) */}}
{{- $containerMemory := (($merged.resources | default dict).limits | default dict).memory }}
{{- if and $containerMemory (ne (toString $merged.memoryLimit) "auto") }}
{{- if gt (include "eugo-dask.daskBytes" (dict "size" $merged.memoryLimit "of" $containerMemory) | float64) (include "eugo-dask.bytes" $containerMemory | float64) }}
{{- fail (printf "workerGroups[%d] (%s).memoryLimit: %s is above the container's memory limit %s (resources.limits.memory): the kernel would kill the worker (OOMKilled) before Dask spills, pauses or restarts it. Set it at or below the limit, or auto (Dask reads the container's limit)" $i $group.name (toString $merged.memoryLimit) (toString $containerMemory)) }}
{{- end }}
{{- end }}
{{- if $merged.maxSpill }}
{{- if ge (include "eugo-dask.bytes" $merged.maxSpill | float64) (include "eugo-dask.bytes" $merged.scratchSizeLimit | float64) }}
{{- fail (printf "workerGroups[%d] (%s).maxSpill: %s must be below scratchSizeLimit %s (the /tmp emptyDir workers spill to; past it the kubelet evicts the pod)" $i $group.name $merged.maxSpill $merged.scratchSizeLimit) }}
{{- end }}
{{- end }}
{{- $groups = append $groups $merged }}
{{- end }}
{{- range $name, $_ := .Values.workerReplicas }}
{{- if not (has $name $names) }}
{{- fail (printf "workerReplicas.%s: no worker group is named %q (groups: %s)" $name $name (join ", " $names)) }}
{{- end }}
{{- end }}
{{- toJson $groups }}
{{- end -}}

{{/* A Kubernetes quantity (the chart's scratchSizeLimit and maxSpill pattern) in bytes, as a
     float64 string. */}}
{{- define "eugo-dask.bytes" -}}
{{- $number := regexFind "^[0-9.]+" (toString .) }}
{{- $unit := trimPrefix $number (toString .) }}
{{- $units := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18
      "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- mulf (float64 $number) (get $units $unit) -}}
{{- end -}}

{{/* Dask's --memory-limit (a size as dask.utils.parse_bytes reads it, units in any case; or
     a fraction of the memory "of", at most 1) in bytes, as a float64 string. (size, of) */}}
{{- define "eugo-dask.daskBytes" -}}
{{- $text := toString .size | replace " " "" }}
{{- $number := regexFind "^[0-9.]+" $text }}
{{- $unit := trimPrefix $number $text | lower | trimSuffix "b" }}
{{- $units := dict "" 1.0 "k" 1e3 "m" 1e6 "g" 1e9 "t" 1e12 "p" 1e15
      "ki" 1024.0 "mi" 1048576.0 "gi" 1073741824.0 "ti" 1099511627776.0 "pi" 1125899906842624.0 }}
{{- if and (eq $unit "") (le (float64 $number) 1.0) }}
{{- mulf (float64 $number) (include "eugo-dask.bytes" .of | float64) -}}
{{- else }}
{{- mulf (float64 $number) (get $units $unit) -}}
{{- end }}
{{- end -}}

{{/* resources with cpu and memory (requests and limits) divided by count: one GPU's share of
     a cuda-worker pod. Others are kept; ephemeral-storage is left to the pod's own scratch.
     (resources, count) */}}
{{- define "eugo-dask.gpuShare" -}}
{{- $share := dict }}
{{- range $kind, $amounts := (.resources | default dict) }}
{{- $out := dict }}
{{- range $name, $amount := $amounts }}
{{- if eq $name "cpu" }}
{{- $millis := include "eugo-dask.millicores" $amount | float64 }}
{{- $_ := set $out $name (printf "%dm" (divf $millis $.count | ceil | int64)) }}
{{- else if eq $name "memory" }}
{{- $_ := set $out $name (toString (divf (include "eugo-dask.bytes" $amount | float64) $.count | floor | int64)) }}
{{- else if ne $name "ephemeral-storage" }}
{{- $_ := set $out $name $amount }}
{{- end }}
{{- end }}
{{- $_ := set $share $kind $out }}
{{- end }}
{{- toJson $share }}
{{- end -}}

{{/* A CPU quantity ("4", "0.5", "1500m") in millicores, as a float64 string. */}}
{{- define "eugo-dask.millicores" -}}
{{- $text := toString . }}
{{- if hasSuffix "m" $text }}
{{- float64 (trimSuffix "m" $text) -}}
{{- else }}
{{- mulf (float64 $text) 1000.0 -}}
{{- end }}
{{- end -}}

{{/* Whether a GPU group scales from zero: the scheduler then plans GPU work while no GPU
     worker has joined (eugo.gpu-workers-on-demand), and the work waits for one. "true" or "". */}}
{{- define "eugo-dask.gpuOnDemand" -}}
{{- range (include "eugo-dask.workerGroups" . | fromJsonArray) }}
{{- if and .autoscaling (eq (int .autoscaling.minReplicas) 0) }}true{{ end }}
{{- end }}
{{- end -}}

{{/* The first GPU group (its gpu.type prices plans; calibration measures it), "{}" if none. */}}
{{- define "eugo-dask.firstGpuGroup" -}}
{{- $first := dict }}
{{- range (include "eugo-dask.workerGroups" . | fromJsonArray) }}
{{- if and .gpu (not $first) }}{{ $first = . }}{{ end }}
{{- end }}
{{- toJson $first }}
{{- end -}}

{{/* image: the pod's image.* over the chart's. (root, pod) */}}
{{- define "eugo-dask.image" -}}
{{- $image := merge (deepCopy (.pod.image | default dict)) .root.Values.image -}}
image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
imagePullPolicy: {{ $image.pullPolicy }}
{{- end -}}

{{/* Pod-level settings shared by every pod. (root, pod, gpus; serviceAccountName and
     automountServiceAccountToken override the pod's) */}}
{{- define "eugo-dask.podSettings" -}}
{{- $pod := .pod }}
{{- $account := .serviceAccountName | default $pod.serviceAccountName }}
automountServiceAccountToken: {{ ternary .automountServiceAccountToken ($pod.automountServiceAccountToken | default false) (hasKey . "automountServiceAccountToken") }}
{{- with $account }}
serviceAccountName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.priorityClassName | default $pod.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with $pod.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $pod.tolerations | default list }}
{{- if .gpus }}
{{- $gpu := dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule" }}
{{- if not (has $gpu $tolerations) }}{{ $tolerations = append $tolerations $gpu }}{{ end }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy ($pod.affinity | default dict) }}
{{- if and (not .gpus) (not $affinity.nodeAffinity) .root.Values.nonGpuNodeAffinity }}
{{- $_ := set $affinity "nodeAffinity" .root.Values.nonGpuNodeAffinity }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pod.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Container settings shared by every container: image, env, resources, securityContext,
     mounts. (root, pod, gpus, gpuResource: the resource they are (nvidia.com/gpu), env: the component's own EnvVars, mounts: its own volumeMounts,
     dask: true for a Dask process, which gets the TLS settings) The pod's env replaces an
     entry of the same name. */}}
{{- define "eugo-dask.containerSettings" -}}
{{ include "eugo-dask.image" . }}
{{- $env := list }}
{{- if not .gpus }}
{{- /* the CUDA base image sets NVIDIA_VISIBLE_DEVICES=all: with nvidia as the default
       runtime, a pod without GPUs would see them all */}}
{{- $env = append $env (dict "name" "NVIDIA_VISIBLE_DEVICES" "value" "void") }}
{{- end }}
{{- $env = concat $env (.env | default list) }}
{{- if and .dask .root.Values.tls.enabled }}
{{- $env = concat $env (include "eugo-dask.tlsEnv" . | fromYamlArray) }}
{{- end }}
{{- $env = concat $env (list
      (dict "name" "HOME" "value" "/tmp")
      (dict "name" "XDG_CACHE_HOME" "value" "/tmp/cache")
      (dict "name" "DASK_TEMPORARY_DIRECTORY" "value" "/tmp/dask")) }}
{{- $own := list }}
{{- range .pod.env }}{{ $own = append $own .name }}{{ end }}
env:
{{- range $env }}
{{- if not (has .name $own) }}
  - {{ toYaml . | nindent 4 | trim }}
{{- end }}
{{- end }}
{{- with .pod.env }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $resources := deepCopy (.pod.resources | default dict) }}
{{- /* the /tmp emptyDir's size, requested: the pod lands where the node has that much disk */}}
{{- $requests := $resources.requests | default dict }}
{{- if not (hasKey $requests "ephemeral-storage") }}
{{- $_ := set $requests "ephemeral-storage" (.pod.scratchSizeLimit | default "1Gi") }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- if .gpus }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits (.gpuResource | default "nvidia.com/gpu") .gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
resources:
  {{- toYaml $resources | nindent 2 }}
securityContext:
  {{- toYaml .root.Values.containerSecurityContext | nindent 2 }}
volumeMounts:
  - name: scratch
    mountPath: /tmp
{{- if and .dask .root.Values.tls.enabled }}
  - {name: dask-tls, mountPath: /etc/dask/tls, readOnly: true}
{{- end }}
{{- with .mounts }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.volumeMounts }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The eugo settings as Dask config. (root, device, client: true for a pod that runs client
     code, the helm test, which also gets the client defaults minSpeedup and learn; they travel
     with each client's graphs, so the scheduler and workers never read them, and a change to
     them must not change their pod templates, which would restart the cluster) */}}
{{- define "eugo-dask.eugoEnv" -}}
- {name: DASK_EUGO__DEVICE, value: {{ .device | quote }}}
- {name: DASK_EUGO__RESOURCE, value: {{ .root.Values.eugo.resource | quote }}}
{{- if .client }}
- {name: DASK_EUGO__MIN_SPEEDUP, value: {{ .root.Values.eugo.minSpeedup | quote }}}
- {name: DASK_EUGO__LEARN, value: {{ .root.Values.eugo.learn | quote }}}
{{- end }}
{{- end -}}

{{/* Volumes: the /tmp scratch emptyDir (size-limited), the TLS Secret for a Dask process,
     the component's, the pod's. (root, pod, dask, volumes) */}}
{{- define "eugo-dask.volumes" -}}
- name: scratch
  emptyDir:
    sizeLimit: {{ .pod.scratchSizeLimit | default "1Gi" }}
{{- if and .dask .root.Values.tls.enabled }}
- {{ include "eugo-dask.tlsVolume" .root }}
{{- end }}
{{- with .volumes }}
{{ toYaml . }}
{{- end }}
{{- with .pod.volumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "eugo-dask.probes" -}}
{{- with .readinessProbe }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .livenessProbe }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A worker pod's dashboard ports (each with /metrics): 8788, and with cuda-worker one per GPU
     process, 8788 + n named http-gpu-<n>. (a merged group) */}}
{{- define "eugo-dask.workerDashboardPorts" -}}
- {name: http-dashboard, containerPort: 8788}
{{- if eq ((.gpu | default dict).mode | default "") "cuda-worker" }}
{{- range $n := untilStep 1 (int .gpu.count) 1 }}
- {name: {{ printf "http-gpu-%d" $n }}, containerPort: {{ add 8788 $n }}}
{{- end }}
{{- end }}
{{- end -}}

{{/* The names of every worker group's dashboard ports. */}}
{{- define "eugo-dask.workerDashboardPortNames" -}}
{{- $names := list }}
{{- range (include "eugo-dask.workerGroups" . | fromJsonArray) }}
{{- range (include "eugo-dask.workerDashboardPorts" . | fromYamlArray) }}
{{- $names = append $names .name }}
{{- end }}
{{- end }}
{{- toJson ($names | uniq) }}
{{- end -}}

{{/* Every worker group's pods. */}}
{{- define "eugo-dask.workerPodSelector" -}}
matchExpressions:
  - {key: app.kubernetes.io/instance, operator: In, values: [{{ .Release.Name | quote }}]}
  - key: app.kubernetes.io/component
    operator: In
    values:
      {{- range include "eugo-dask.workerGroups" . | fromJsonArray }}
      - {{ printf "%s-worker" .name }}
      {{- end }}
{{- end -}}
