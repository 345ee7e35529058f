{{- define "nymph.fullname" -}}
{{ .Release.Name }}
{{- end }}

{{- define "nymph.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nymph.labels" -}}
{{ include "nymph.selectorLabels" . }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "nymph.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}
