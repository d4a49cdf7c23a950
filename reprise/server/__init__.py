"""The service around the decode backend: wiring (``service``), authentication, the admin plane,
metering and metrics, the history writer, tenant settings, the tenants' indexes and the dashboard."""
