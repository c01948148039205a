"""Sequence parallelism: each stage on ``sp`` ranks, attention passed round their ring (ring or Ring Self-Attention)."""

from __future__ import annotations

from ..modes import Attention
from . import Flag, Technique, register, size_text


class SequenceParallel(Technique):
    name = "sequence_parallel"
    summary = "each sequence split over the sp ranks of a stage; keys and values passed round a ring"
    flags = (Flag("sp", "sequence-parallel ranks per stage: each holds a share of every sequence (default 1)", type=int),
             Flag("attention", "sequence-parallel attention: blockwise ring (the default with --sp > 1) or Ring "
                  "Self-Attention; with --sp 1 the default is torch's scaled_dot_product_attention",
                  metavar="ring|rsa"))

    def active(self, spec) -> bool:
        return spec.sp > 1

    def check(self, spec) -> None:
        if spec.attention is not None:
            Attention.of(spec.attention)
        if spec.sp > 1:
            spec.check_seq_split()

    def cost_options(self, spec) -> dict:
        return {"sp": spec.sp, "attention": spec.attention}

    def pipeline_options(self, spec, costs) -> dict:
        return {"sp": spec.sp, "attention": spec.attention}

    def runtime_part(self):
        from ..runtime.batches import SequencePart

        return SequencePart

    def describe(self, spec, pipe) -> str:
        return f", sp={spec.sp} ({pipe.attention})" if self.active(spec) else ""

    def report(self, result, priced) -> dict:
        """The sequence-parallel fields: the ring's transfers per stage, one layer's details, rsa's and ring's scores."""
        from dataclasses import asdict

        from ..modes import Attention
        from ..sim.formulas import sequence_parallel_costs
        from ..sim.stages import stage_layers

        if priced.model is None or not (priced.spec.sp > 1 or priced.spec.attention is not None):
            return {}
        spec, model, device, schedule = priced.spec, priced.model, priced.device, result.schedule
        sp, seq, size = spec.sp, spec.seq, spec.microbatch_size
        precision = spec.costed_precision
        layer = sequence_parallel_costs(model, seq, size, device, sp, spec.attention, precision)
        layers = stage_layers(model, schedule.stages, seq, vocab_parallel=spec.vocab_mode)
        scores = {}
        for name in Attention:
            other = sequence_parallel_costs(model, seq, size, device, sp, name, precision)
            scores[name] = {"kept": other.kept_bytes, "transient": other.transient_bytes}
        return {
            "sp": sp,
            "attention": layer.attention,
            "sp_comm_ms": [n * layer.comm_ms for n in layers],
            "sp_exposed_ms": [n * (layer.exposed_forward_ms + layer.exposed_backward_ms) for n in layers],
            "sp_layer": {k: v for k, v in asdict(layer).items() if k not in ("sp", "attention")},
            "score_bytes": scores,
        }

    def report_lines(self, report: dict) -> list[str]:
        if "sp" not in report:
            return []
        layer, scores = report["sp_layer"], report["score_bytes"]
        ring = report["attention"] == "ring"
        transfers = [
            f"sp={report['sp']}, {report['attention']} attention: per layer and microbatch {layer['steps']} forward "
            f"steps of {size_text(layer['step_bytes'])} ({'K and V' if ring else 'K, then V'}), {layer['step_ms']:.4g} ms each",
            f"  ring transfers of a microbatch's F and B: up to {max(report['sp_comm_ms']):.4g} ms per stage, "
            f"{max(report['sp_exposed_ms']):.4g} ms of it not hidden by compute",
        ] if report["sp"] > 1 else [f"sp=1, {report['attention']} attention: one rank per stage, no ring transfers"]
        return [
            *transfers,
            f"  attention scores per layer and microbatch: rsa keeps {size_text(scores['rsa']['kept'])}; ring keeps "
            f"{size_text(scores['ring']['kept'])} (log-sum-exp) and computes in one {size_text(scores['ring']['transient'])} block",
        ]


register(SequenceParallel())
