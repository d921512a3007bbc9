"""`verify` (SPEC 9), the report without I/O: one line per probe (table) or one object per probe (JSON), the
verdict, the exit code and the progress line. `inspection.verify` says where each probe is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .verify import OUTPUT_LINES, STAGES, Stage, Status
from .verify_template import Check


@dataclass
class Probe:
    name: str
    namespace: str
    runtime: str                       # KIND/NAME
    pinned: str = ""                   # the node it was pinned to (--per-node)
    status: Status = field(default_factory=lambda: Status(None))
    output: str = ""                   # the last lines of the binary's output
    checks: list[Check] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.status.node or self.pinned

    def stages(self) -> list[dict[str, Any]]:
        out = []
        reached = -1 if self.status.reached is None else STAGES.index(self.status.reached)
        for i, stage in enumerate(STAGES):
            if i <= reached:
                state, message = "reached", ""
                if stage is Stage.RAN:
                    message = f"exit code {self.status.exit_code}"
            elif self.status.failure is not None and self.status.failure.stage is stage:
                state, message = "failed", self.status.failure.message
            else:
                state, message = "not-reached", ""
            out.append({"stage": stage.value, "state": state, "message": message})
        return out

    def as_json(self) -> dict[str, Any]:
        f = self.status.failure
        return {"name": self.name, "namespace": self.namespace, "runtime": self.runtime, "node": self.node,
                "pod": self.status.pod, "reached": self.status.reached.value if self.status.reached else None,
                "ran": self.status.ran, "exitCode": self.status.exit_code, "output": self.output,
                "failure": {"stage": f.stage.value, "message": f.message, "hint": f.hint, "cause": f.cause or None}
                if f else None,
                "stages": self.stages(),
                "checks": [{"check": c.what, "expected": c.expected, "found": c.found, "ok": c.ok}
                           for c in self.checks]}


def exit_code(probes: list[Probe]) -> int:
    return 0 if probes and all(p.status.ran for p in probes) else 1


def render_json(probes: list[Probe]) -> str:
    return json.dumps([p.as_json() for p in probes], indent=2) + "\n"


def render_table(probes: list[Probe], deleted: bool = True) -> str:
    rows = [("PROBE", "NODE", "REACHED", "RESULT")]
    notes: list[list[str]] = []
    for p in probes:
        st = p.status
        if st.failure is not None:
            result = f"FAILED at {st.failure.stage.value}: {st.failure.message}"
            extra = [f"what to do: {st.failure.hint}"]
        else:
            result = f"ran, exit code {st.exit_code}"
            extra = []
        if p.output:
            extra.append("output: " + " | ".join(p.output.splitlines()[-OUTPUT_LINES:]))
        for c in p.checks:
            extra.append(f"{'ok' if c.ok else 'DIFFERS'}: {c.what}: {c.found}"
                         + ("" if c.ok else f" (the settings say {c.expected})"))
        rows.append((p.name, p.node or "-", st.reached.value if st.reached else "-", result))
        notes.append(extra)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{rows[0][0]:<{widths[0]}}  {rows[0][1]:<{widths[1]}}  {rows[0][2]:<{widths[2]}}  {rows[0][3]}"]
    for row, extra in zip(rows[1:], notes, strict=True):
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")
        lines += [f"    {x}" for x in extra]
    lines.append(verdict(probes, deleted))
    return "\n".join(lines) + "\n"


def verdict(probes: list[Probe], deleted: bool = True) -> str:
    ran = sum(p.status.ran for p in probes)
    runtime = probes[0].runtime if probes else "?"
    kept = "" if deleted else " (probes kept: --keep)"
    if probes and ran == len(probes):
        return f"ok: {ran} of {len(probes)} probes on {runtime} ran the binary through the publish mount{kept}"
    failed = sorted({p.status.failure.stage.value for p in probes if p.status.failure}, key=lambda s: STAGES.index(
        Stage(s)))
    return f"FAILED: {len(probes) - ran} of {len(probes)} probes on {runtime} did not run the binary" \
           f" (failed at: {', '.join(failed)}){kept}"


def progress_line(probes: list[Probe], elapsed: float) -> str:
    parts = []
    for p in probes:
        st = p.status
        where = st.reached.value if st.reached else "creating"
        parts.append(f"{p.name}: {'done at ' if st.done else ''}{where}"
                     + (f" ({st.waiting})" if st.waiting and not st.done else ""))
    return f"[{elapsed:4.0f}s] " + "; ".join(parts)
