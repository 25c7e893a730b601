"""HTTP routers, one module per resource; app.py includes them all."""

from render_server.http.api import (
    admin,
    chat,
    completions,
    derender,
    generate,
    messages,
    models,
    render,
    responses,
    server_info,
    tokenize,
)

ROUTERS = (
    admin.router,
    models.router,
    tokenize.router,
    chat.router,
    completions.router,
    generate.router,
    render.router,
    derender.router,
    messages.router,
    responses.router,
    server_info.router,
)
