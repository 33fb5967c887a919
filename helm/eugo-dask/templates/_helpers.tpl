{{- define "eugo-dask.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "eugo-dask.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: scheduler, cpu-worker, gpu-worker */}}
{{- define "eugo-dask.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "eugo-dask.schedulerAddress" -}}
{{- printf "tcp://%s-scheduler:%v" (include "eugo-dask.fullname" .) .Values.scheduler.port -}}
{{- end -}}

{{- define "eugo-dask.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* eugo and writable-scratch environment shared by every container */}}
{{- define "eugo-dask.env" -}}
- name: DASK_EUGO__MIN_SPEEDUP
  value: {{ .Values.eugo.minSpeedup | quote }}
- name: DASK_EUGO__PROFILE
  value: {{ .Values.eugo.profile | quote }}
- name: DASK_EUGO__RESOURCE
  value: {{ .Values.eugo.resource | quote }}
- name: DASK_EUGO__LEARN
  value: {{ .Values.eugo.learn | quote }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: DASK_TEMPORARY_DIRECTORY
  value: /tmp/dask
{{- end -}}

{{- define "eugo-dask.scratch" -}}
- name: scratch
  emptyDir: {}
{{- end -}}
