"""``GET /v1/usage`` (the caller's own key's usage) and ``/v1/admin/drain`` (operators).

* ``GET /v1/usage``: the usage of the key that asks (``Authorization: Bearer``, or a
  browser token, which counts as its key): characters, audio seconds, contexts
  (:mod:`rtts.core.usage`). 401 without a key when keys are configured. With no keys
  configured there is one tenant: it answers the ``anonymous`` usage, everything this
  server (or, with Redis, every instance sharing it) has spoken. ``scope`` says which:
  ``shared`` (summed in Redis over the instances) or ``instance``.
* ``POST /v1/admin/drain`` (an ``--admin-key`` only): start the graceful drain SIGTERM
  starts (``/readyz`` 503, new streams and requests refused, open ones finish); the
  answer (202) and ``GET /v1/admin/drain`` say how many sessions remain, until 0. The
  process keeps running, draining, until it is stopped (SIGTERM then ends it at once
  when nothing is left). 401 without the admin key, 403 when none is configured.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator, AuthError
from rtts.api.http.common import auth_api_error, authorize
from rtts.core.service import Service, State

__all__ = ["AdminEndpoints"]

logger = logging.getLogger("rtts.api.admin")

_NO_STORE = {"Cache-Control": "no-store"}


class AdminEndpoints:
    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth

    def routes(self) -> list[Route]:
        return [Route("/v1/usage", self.usage, methods=["GET"]),
                Route("/v1/admin/drain", self.drain, methods=["GET", "POST"])]

    async def usage(self, request: Request) -> Response:
        kid = authorize(self.auth, self.service, request, admit=False)
        account = self.auth.owner(kid)
        service = self.service
        local = service.usage.of(account)
        shared = (await service.usage_flusher.shared(account)
                  if service.usage_flusher is not None else None)
        body: dict[str, Any] = {
            "key": account or "anonymous",
            # the key id (its job queue is rtts:jobs:queue:<key_id>; stable across
            # instances and restarts with a shared --token-secret)
            "key_id": kid,
            "scope": "shared" if shared is not None else "instance",
            **(shared or local).as_dict(),
            "instance": {"id": service.config.instance_id, **local.as_dict()}}
        return JSONResponse(body, headers=_NO_STORE)

    async def drain(self, request: Request) -> Response:
        try:
            self.auth.check_admin(request.headers.get("authorization"))
        except AuthError as exc:
            self.service.stats.auth_rejected_by[exc.kind] += 1
            raise auth_api_error(exc) from None
        service = self.service
        started = False
        if request.method == "POST" and service.state != State.DRAINING:
            logger.info("drain requested through the admin API")
            service.start_drain()
            started = True
        draining = service.state == State.DRAINING
        left = service.sessions_left()
        return JSONResponse({"state": str(service.state), "draining": draining,
                             "sessions": left, "done": draining and left == 0,
                             "instance": service.config.instance_id},
                            status_code=202 if started else 200, headers=_NO_STORE)
