{{/* The release name, cut to a DNS label: every object of the release is named so. */}}
{{- define "lakeshore.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{- define "lakeshore.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "lakeshore.labels" -}}
{{ include "lakeshore.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "lakeshore.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end }}

{{/* Several processes or pods share live frames only through Redis: refuse the chart without it. */}}
{{- define "lakeshore.checkRedis" -}}
{{- if and (or (gt (int .Values.replicas) 1) (gt (int .Values.workers) 1)) (not .Values.redis.url) -}}
{{- fail "replicas > 1 or workers > 1 needs redis.url: live frames must reach followers on every process" -}}
{{- end -}}
{{- end }}

{{/* The blob directory lives on a volume when no bucket is set. */}}
{{- define "lakeshore.blobVolume" -}}
{{- not .Values.blobs.bucket -}}
{{- end }}
