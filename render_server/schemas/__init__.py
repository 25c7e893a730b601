"""Pydantic models of the HTTP API, one module per resource.

Convention: tags of discriminated unions are written `<name>`; the error handler drops
such parts from validation error locations so `param` is the client's own field path.
"""
