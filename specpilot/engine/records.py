"""What an engine's steps did: one `StepRecord` per pass, and the running counts that `Engine.stats` reports.
Shared by the single-request engine (`engine`) and batched decoding (`batch`), which import it and not each
other's modules."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepRecord", "nan_logits_error"]


@dataclass
class StepRecord:
    kind: str  # "prefill", "ar", "verify"
    nodes: int  # nodes in the pass (root included)
    emitted: int  # tokens the step emitted
    seconds: float


@dataclass
class _Stats:
    steps: list[StepRecord] = field(default_factory=list)
    q_agree: int = 0  # two-level verification: Q-pass choices the exact pass confirmed
    q_total: int = 0

    def summary(self) -> dict:
        out = {}
        for kind in ("ar", "verify", "batch"):
            rec = [s for s in self.steps if s.kind == kind]
            if not rec:
                continue
            secs = sorted(s.seconds for s in rec)
            emitted, total = sum(s.emitted for s in rec), sum(secs)
            # mean_step_ms and tokens_per_s both come from the total time, so tokens_per_s = tau / mean step time
            out[kind] = {"steps": len(rec), "tokens": emitted, "tau": emitted / len(rec),
                         "mean_nodes": sum(s.nodes for s in rec) / len(rec),
                         "median_step_ms": 1e3 * secs[len(secs) // 2], "mean_step_ms": 1e3 * total / len(rec),
                         "tokens_per_s": emitted / total if total > 0 else float("inf"), "total_s": total}
        if self.q_total:
            out["q_pass"] = {"agreement": self.q_agree / self.q_total, "compared": self.q_total}
        pre = [s for s in self.steps if s.kind == "prefill"]
        if pre:
            out["prefill"] = {"tokens": sum(s.nodes for s in pre), "total_s": sum(s.seconds for s in pre)}
        return out


def nan_logits_error(fn: str, where: str) -> RuntimeError:
    """The error of a step whose target logits held NaN (the certified head's argmax is lmhead.NAN_ID there, which
    is not a token to emit or feed back); `where` names the request and new token."""
    return RuntimeError(f"{fn}: the target's logits held NaN {where} (the certified head's argmax is lmhead.NAN_ID "
                        "there); check the checkpoint's weights for NaN/Inf and load it in BF16")
