"""The instance registry over HTTP, as LMCache 0.5.6's coordinator serves it.

``POST /instances`` (register; a blank id gets a generated one), ``PUT
/instances/{id}/heartbeat`` (404 ``{"error": "unknown instance <id>; re-register"}`` makes
LMCache's ``keep_registered`` re-register), ``GET /instances``, ``DELETE /instances/{id}``
(204, idempotent: fences the instance's private L1 placements, forgets its event cursor and
its declared capacity), ``GET /instances/usage`` and ``GET /instances/{id}/usage`` (used
bytes joined to declared capacity). The registry itself is ``blendmatch.index.registry``;
the reaper that expires silent instances is ``ServiceContext.reap_once``.

Each call goes to the context's event source (``event_source.py``), which applies it
here (HTTP push; with ``--upstream-coordinator`` then forwarded upstream in order, a
registration with the id this coordinator gave it) or appends it to the Kafka log; both
apply registry records through the one ``sources/control.py``.

Registry calls do not touch the directory lock except deregistration, which runs on the
events thread so that it is ordered with the instance's event batches.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from blendmatch.index.logsafe import log_safe
from blendmatch.index.wire_models import WholeInt

from .access import instance_filter
from .context import Ctx
from .errors import Forbidden, TooManyInstances
from .routes_lookup import ERROR_RESPONSES

__all__ = ["router", "RegisterRequest", "RegisterResponse", "HeartbeatResponse"]

router = APIRouter(tags=["instances"])


#: What LMCache's ``strip_whitespace`` strips: pydantic's (Rust's) Unicode White_Space, not
#: Python's ``isspace`` (which also takes U+001C..U+001F).
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
                + "\u2028\u2029\u202f\u205f\u3000")
#: "Not blank": one character that is not :data:`_WHITE_SPACE`, as an explicit class, so that
#: the schema's regex means the same in every engine (``\S`` does not).
_NOT_BLANK = f"[^{_WHITE_SPACE}]"


def _stripped(value: str) -> str:
    return value.strip(_WHITE_SPACE)


def _not_blank(value: str) -> str:
    stripped = _stripped(value)
    if not stripped:
        raise ValueError(f"must not be blank, got {value!r}")
    return stripped


# Registration strings are bounded as sent (so the schema's maxLength is the rule: a bound
# checked after stripping accepted what the schema refuses), then stripped as LMCache does.
_InstanceId = Annotated[str, StringConstraints(max_length=256), AfterValidator(_stripped)]
#: Blank after stripping is refused (LMCache's rule), and the schema says so.
_Ip = Annotated[str, StringConstraints(max_length=256), AfterValidator(_not_blank),
                Field(json_schema_extra={"minLength": 1, "pattern": _NOT_BLANK})]
_Url = Annotated[str, StringConstraints(max_length=2048), AfterValidator(_stripped)]


class RegisterRequest(BaseModel):
    """Body of ``POST /instances`` (LMCache's ``RegisterRequest``; unknown fields ignored).
    Strict types (``false`` and ``"80"`` are not ports), as every body of this service; an
    integral float (``244.0``) is an integer, as in LMCache."""

    model_config = ConfigDict(strict=True, extra="ignore")

    instance_id: _InstanceId = Field(
        default="", description="blank: the coordinator generates one and returns it")
    ip: _Ip
    http_port: WholeInt = Field(ge=1, le=65535)
    metadata: dict[str, str] = Field(default_factory=dict)
    p2p_advertised_url: _Url = ""
    mq_port: WholeInt = Field(default=0, ge=0, le=65535)


class RegisterResponse(BaseModel):
    instance_id: str
    re_registered: bool


class HeartbeatResponse(BaseModel):
    instance_id: str


class UnknownInstance(BaseModel):
    """404 of a heartbeat (LMCache's body: the server re-registers on it)."""

    error: str


class InstanceInfo(BaseModel):
    instance_id: str
    ip: str
    http_port: int
    registration_time: float
    metadata: dict[str, str] = Field(default_factory=dict)
    p2p_advertised_url: str = ""
    mq_port: int = 0


class InstanceListResponse(BaseModel):
    instances: list[InstanceInfo] = Field(default_factory=list)


class ModuleMemoryStatus(BaseModel):
    """One compartment: ``usage_ratio`` is ``used_bytes / capacity_bytes``, or null when no
    capacity was declared (``capacity_bytes`` 0)."""

    tier: str
    backend: str
    shared: bool
    used_bytes: int
    capacity_bytes: int
    usage_ratio: float | None = None


class InstanceMemoryStatus(BaseModel):
    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: list[ModuleMemoryStatus] = Field(default_factory=list)


class FleetMemoryResponse(BaseModel):
    instances: list[InstanceMemoryStatus] = Field(default_factory=list)
    shared_modules: list[ModuleMemoryStatus] = Field(default_factory=list)


@router.post("/instances", response_model=RegisterResponse, responses={422: ERROR_RESPONSES[422]})
async def register_instance(body: RegisterRequest, ctx: Ctx, request: Request) -> dict[str, Any]:
    """Register (or re-register) an MP server; counts as its first heartbeat. A producer
    credential limited to instance-id patterns may register only ids it matches (403)."""
    may_act_for = instance_filter(request.scope)
    if may_act_for is not None and not (body.instance_id and may_act_for(body.instance_id)):
        raise Forbidden(f"body.instance_id: this credential may not register instance "
                        f"{log_safe(body.instance_id)!r} (its instance patterns do not match; a blank id "
                        "cannot match; see docs/security.md)")
    limit = ctx.config.max_instances
    if (not body.instance_id or not ctx.registry.contains(body.instance_id)) and len(ctx.registry) >= limit:
        raise TooManyInstances(f"body.instance_id: registering one more instance than the {limit} this server "
                               "tracks (--max-instances); ids leave when their instance deregisters or expires")
    instance_id, again = await ctx.events.register(body.model_dump())
    return {"instance_id": instance_id, "re_registered": again}


@router.put("/instances/{instance_id}/heartbeat", response_model=HeartbeatResponse,
            responses={404: {"model": UnknownInstance, "description": "unknown instance: re-register"}})
async def heartbeat(instance_id: str, ctx: Ctx) -> Any:
    """Record a heartbeat; 404 (LMCache's body) for an unknown instance."""
    if await ctx.events.heartbeat(instance_id):
        return {"instance_id": instance_id}
    return JSONResponse(status_code=404, content={"error": f"unknown instance {instance_id}; re-register"})


@router.get("/instances", response_model=InstanceListResponse)
async def list_instances(ctx: Ctx) -> dict[str, Any]:
    """Every registered MP server, in registration order."""
    return {"instances": ctx.registry.list()}


@router.delete("/instances/{instance_id}", status_code=204, response_class=Response,
               responses={422: ERROR_RESPONSES[422]})
async def deregister_instance(instance_id: str, ctx: Ctx) -> Response:
    """Deregister: drop the instance's private L1 placements (its L2 and shared-pool ones
    stay), its event cursor (a reconnect starts fresh) and its declared capacity.
    Idempotent; 204 whether or not it was registered, as in LMCache."""
    await ctx.events.deregister(instance_id)  # Kafka mode: applied by every replica, this one before the reply
    return Response(status_code=204)


@router.get("/instances/usage", response_model=FleetMemoryResponse)
async def fleet_usage(ctx: Ctx) -> Any:
    """Memory status of every MP server (registered, holding bytes, or having declared
    capacity) and of the shared pools (counted once)."""
    return await ctx.read(ctx.registry.usage, ctx.directory)


@router.get("/instances/{instance_id}/usage", response_model=InstanceMemoryStatus,
            responses={404: {"description": "unknown instance"}})
async def instance_usage(instance_id: str, ctx: Ctx) -> Any:
    """One MP server's memory status; 404 when it is not registered, holds no bytes and
    declared nothing."""
    got = await ctx.read(ctx.registry.usage, ctx.directory, instance_id)
    if got is None:
        return JSONResponse(status_code=404, content={"detail": f"unknown instance {instance_id!r}"})
    return got
