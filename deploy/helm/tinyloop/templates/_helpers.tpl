{{- define "tinyloop.name" -}}{{ .Release.Name }}-tinyloop{{- end -}}
{{- define "tinyloop.labels" -}}
app.kubernetes.io/name: tinyloop
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "tinyloop.selector" -}}
app.kubernetes.io/name: tinyloop
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: replica
{{- end -}}
{{- define "tinyloop.routerSelector" -}}
app.kubernetes.io/name: tinyloop
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}
