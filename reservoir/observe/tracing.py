"""OpenTelemetry traces of placements, carried across the broker (the ``otel`` extra).

reservoir speaks the OpenTelemetry *API* only, as a library should: the application
chooses an SDK, exporters and sampling (``reservoir node`` and ``reservoir serve`` set one
up from the standard ``OTEL_TRACES_EXPORTER`` variable: :func:`configure_from_environment`).
Spans are made only while a real tracer provider is set; without OpenTelemetry, or with the
API alone, every function here returns at once and no message changes.

The spans of one placement:

- ``reservoir.place`` (requestor, client kind): from ``Requestor.submit`` to the outcome,
  a child of whatever span is current for the caller (``reservoir serve``'s
  ``POST /v1/reservations`` server span, which continues the HTTP caller's
  ``traceparent``). Its context goes out as the ``traceparent`` field of every
  :class:`~reservoir.protocol.messages.ReservationRequest` and
  :class:`~reservoir.protocol.messages.Award` of the conversation.
- ``reservoir.node.evaluate`` (each node that hears the request, consumer kind): the
  node's filters and weighers and its answer (offer, decline, silence, assessment).
- ``reservoir.node.award`` (each winner): the award turned into allocations, or refused.

So one trace id runs from the HTTP call through every node's offer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from reservoir.version import __version__, install_hint

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from reservoir.protocol.effects import Effect
    from reservoir.protocol.messages import Message

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the core package runs without the otel extra
    otel_trace = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE",
    "Traced",
    "configure_from_environment",
    "end_place",
    "extract",
    "node_span",
    "start_place",
    "tracer",
    "use",
]

#: whether the OpenTelemetry API is installed
AVAILABLE: Final = otel_trace is not None
TRACER_NAME: Final = "reservoir"

_PROPAGATOR: Any = TraceContextTextMapPropagator() if otel_trace is not None else None
#: (provider, its tracer): asking the provider for a tracer on every placement would cost
_cached: tuple[object, Any] | None = None
#: a provider for reservoir's spans alone, instead of the global one (see :func:`use`)
_provider: Any = None


def use(provider: Any) -> None:
    """Make reservoir's spans with ``provider`` (an SDK ``TracerProvider``) instead of the
    global one; None goes back to the global. For tests, and for an application that
    traces reservoir apart from the rest."""
    global _provider
    _provider = provider


def tracer() -> Tracer | None:
    """reservoir's tracer, or None while nothing would record a span (OpenTelemetry is
    not installed, or no tracer provider is set)."""
    global _cached
    if otel_trace is None:
        return None
    provider = _provider if _provider is not None else otel_trace.get_tracer_provider()
    if isinstance(provider, otel_trace.ProxyTracerProvider | otel_trace.NoOpTracerProvider):
        return None
    cached = _cached
    if cached is not None and cached[0] is provider:
        found: Tracer = cached[1]
        return found
    made = provider.get_tracer(TRACER_NAME, __version__)
    _cached = (provider, made)
    return made


def _traceparent(span: Span) -> str | None:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=otel_trace.set_span_in_context(span))
    return carrier.get("traceparent")


def start_place(request_id: str, resources: dict[str, int], count: int) -> tuple[Any, str | None]:
    """A ``reservoir.place`` span for a request, child of the caller's current span, and
    the ``traceparent`` its messages carry; ``(None, None)`` when not tracing."""
    active = tracer()
    if active is None:
        return None, None
    span = active.start_span(
        "reservoir.place",
        kind=otel_trace.SpanKind.CLIENT,
        attributes={
            "reservoir.request_id": request_id,
            "reservoir.count": count,
            **{f"reservoir.resources.{rc}": amount for rc, amount in resources.items()},
        },
    )
    return span, _traceparent(span)


def end_place(
    span: Any, outcome: str, error: BaseException | None = None, **attributes: Any
) -> None:
    """End a ``reservoir.place`` span with its outcome (``placed``, ``failed``, ...)."""
    span.set_attribute("reservoir.outcome", outcome)
    for name, value in attributes.items():
        span.set_attribute(f"reservoir.{name}", value)
    if error is not None:
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(error)[:500]))
    span.end()


def extract(headers: dict[str, str]) -> Any:
    """The trace context an incoming carrier (HTTP headers) names, for a server span."""
    return _PROPAGATOR.extract(headers)


class Traced:
    """A span made current for a block (``with Traced(...)``): for a server span around an
    HTTP request. Does nothing when not tracing."""

    def __init__(self, name: str, *, parent: dict[str, str] | None = None, kind: str = "SERVER"):
        self.span: Any = None
        self._token: Any = None
        active = tracer()
        if active is None:
            return
        context = extract(parent) if parent else None
        self.span = active.start_span(name, context=context, kind=otel_trace.SpanKind[kind])
        self._token = otel_context.attach(otel_trace.set_span_in_context(self.span))

    def __enter__(self) -> Traced:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: Any
    ) -> None:
        if self.span is None:
            return
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(error)[:500]))
        self.span.end()
        otel_context.detach(self._token)


def node_span(node: str, message: Message, handle: Callable[[], list[Effect]]) -> list[Effect]:
    """Run a node's ``handle`` of a traced request or award inside a span that continues
    the requestor's trace, describing the node's answer; just ``handle()`` otherwise."""
    traceparent = getattr(message, "traceparent", None)
    active = tracer() if traceparent is not None else None
    if active is None:
        return handle()
    from reservoir.protocol.messages import ReservationRequest

    parent = _PROPAGATOR.extract({"traceparent": traceparent})
    is_request = isinstance(message, ReservationRequest)
    span = active.start_span(
        "reservoir.node.evaluate" if is_request else "reservoir.node.award",
        context=parent,
        kind=otel_trace.SpanKind.CONSUMER,
        attributes={"reservoir.node": node, "reservoir.request_id": message.request_id},
    )
    try:
        effects = handle()
    except BaseException as error:
        span.record_exception(error)
        span.end()
        raise
    span.set_attribute("reservoir.answer", _answer(effects))
    if is_request:
        span.set_attribute("reservoir.attempt", getattr(message, "attempt", 0))
    span.end()
    return effects


def _answer(effects: Sequence[Effect]) -> str:
    """What the node said: the kind of the first message it sent back, or ``none``."""
    from reservoir.protocol.effects import Send

    for effect in effects:
        if type(effect) is Send:
            return effect.message.kind
    return "none"


def configure_from_environment(service_name: str) -> str | None:
    """Set up the OpenTelemetry SDK for a reservoir process when ``OTEL_TRACES_EXPORTER``
    asks for it (``console``, ``otlp``; ``none`` or unset: nothing is set up). Returns a
    one-line problem to report (the SDK or the exporter is not installed), else None.
    ``OTEL_SERVICE_NAME`` names the service (default: ``service_name``)."""
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if wanted in ("", "none"):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        return f"OTEL_TRACES_EXPORTER needs the OpenTelemetry SDK: {install_hint('otel')}"
    exporter: SpanExporter
    if wanted == "console":
        # stderr: a command's stdout may be its --json answer
        exporter = ConsoleSpanExporter(out=sys.stderr)
    elif wanted == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError:
            return (
                "OTEL_TRACES_EXPORTER=otlp needs an OTLP exporter: "
                "pip install opentelemetry-exporter-otlp-proto-http"
            )
        exporter = OTLPSpanExporter()
    else:
        return f"OTEL_TRACES_EXPORTER={wanted!r}: reservoir knows console, otlp and none"
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    otel_trace.set_tracer_provider(provider)
    return None
