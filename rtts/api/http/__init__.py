"""The HTTP side of the port: the ASGI app and the helpers every HTTP front-end shares.

- :mod:`rtts.api.http.app`: routes, CORS, health, metrics, static files, OpenAPI
- :mod:`rtts.api.http.common`: JSON errors, authorization, body reading, response adapters
"""
