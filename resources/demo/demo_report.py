"""What `train_demo.py` writes next to the weights besides them: the loss curve
(`loss.json`, `loss.svg`) and the demo's answers to fixed prompts (`samples.json`).

The answers come from the product's own engine (`engine.demo` writes the GGUF,
`packer.builder` packs it, `engine.service.EngineService` generates on the CPU), so what
is printed is exactly what a user of these weights gets.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from xml.sax.saxutils import escape

SAMPLE_SEED = 1  # the sampled answers' seed: one fixed draw, so a rebuild can be compared
SAMPLE_PROMPTS = ["Write a Python function that reverses a list.", "What does json.dumps do?",
                  "Explain what a Python dictionary is."]


def write_loss_json(path: Path, log: list[dict], info: dict) -> None:
    path.write_text(json.dumps({**info, "log": log}, indent=1) + "\n", encoding="utf-8")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    span = max(hi - lo, 1e-9)
    raw = span / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def write_loss_svg(path: Path, log: list[dict], title: str) -> None:
    """A line plot of the train and held-out loss per step (hand-written SVG, no plotting library)."""
    width, height, left, right, top, bottom = 720, 420, 64, 150, 40, 52
    series = [("train loss", "train_loss", "#1f6feb"), ("held-out loss", "held_out_loss", "#d1242f")]
    points = {key: [(e["step"], e[key]) for e in log if e.get(key) is not None] for _n, key, _c in series}
    values = [v for pts in points.values() for _s, v in pts]
    steps = [s for pts in points.values() for s, _v in pts]
    if not values:
        values, steps = [0.0, 1.0], [0, 1]
    y_lo, y_hi = 0.0, max(values) * 1.05
    x_lo, x_hi = 0, max(max(steps), 1)

    def x(step: float) -> float:
        return left + (step - x_lo) / (x_hi - x_lo) * (width - left - right)

    def y(value: float) -> float:
        return top + (1 - (value - y_lo) / (y_hi - y_lo)) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2:.0f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for tick in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for tick in _ticks(x_lo, x_hi):
        out.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{height - bottom}" y2="{height - bottom + 5}" '
                   'stroke="black"/>')
        out.append(f'<text x="{x(tick):.1f}" y="{height - bottom + 18}" text-anchor="middle">{tick:g}</text>')
    out.append(f'<path d="M{left},{top} V{height - bottom} H{width - right}" fill="none" stroke="black"/>')
    out.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 12}" text-anchor="middle">'
               'training step</text>')
    out.append(f'<text transform="translate(16,{(top + height - bottom) / 2:.0f}) rotate(-90)" '
               'text-anchor="middle">cross-entropy loss (nats per token)</text>')
    for i, (name, key, colour) in enumerate(series):
        pts = points[key]
        if pts:
            d = " ".join(f"{'M' if j == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for j, (s, v) in enumerate(pts))
            out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"/>')
        ly = top + 16 + i * 20
        out.append(f'<line x1="{width - right + 12}" x2="{width - right + 36}" y1="{ly}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 42}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def demo_answers(weights: Path, prompts: list[str] = SAMPLE_PROMPTS, max_tokens: int = 160) -> list[dict]:
    """The answers of the demo built from `weights` to `prompts`, through the product's engine
    (CPU): greedy (`answer`, reproducible anywhere) and with the app's default sampling and a
    fixed seed (`sampled`: what a user of the chat window sees, one draw of it)."""
    from engine.demo import write_demo_gguf
    from engine.options import RuntimeOptions
    from engine.service import EngineService
    from engine.service_events import DoneEvent, ErrorEvent, GenerateRequest
    from engine.text import SamplingParams
    from packer.builder import build_pack

    events: list = []
    answers = []
    with tempfile.TemporaryDirectory(prefix="expertdesk-demo-samples-") as tmp:
        gguf = write_demo_gguf(Path(tmp) / "demo.gguf", weights)
        pack = Path(tmp) / "demo.expertpack"
        build_pack(gguf, pack, overwrite=True)
        service = EngineService(events.append, RuntimeOptions(device="cpu"))
        try:
            service.load(str(pack))
            if not service.wait_idle(300):
                raise RuntimeError("the demo did not load within 300 s")
            failed = [e for e in events if isinstance(e, ErrorEvent)]
            if failed:
                raise RuntimeError(f"the engine could not load the new demo: {failed[0].message}")

            def answer(prompt: str, sampling: SamplingParams) -> dict:
                events.clear()
                service.submit(GenerateRequest([{"role": "user", "content": prompt}], sampling))
                if not service.wait_idle(600):
                    raise RuntimeError(f"no answer to {prompt!r} within 600 s")
                done = [e for e in events if isinstance(e, (DoneEvent, ErrorEvent))]
                if not done or isinstance(done[0], ErrorEvent):
                    raise RuntimeError(f"the engine failed on {prompt!r}: {done}")
                return {"answer": done[0].text, "stop_reason": done[0].stats.stop_reason,
                        "completion_tokens": done[0].stats.completion_tokens}

            defaults = SamplingParams(max_tokens=max_tokens, seed=SAMPLE_SEED)
            settings = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
                        "min_p": defaults.min_p, "seed": SAMPLE_SEED}
            for prompt in prompts:
                greedy = answer(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
                sampled = answer(prompt, defaults) | {"sampling": settings}
                answers.append({"prompt": prompt, **greedy, "sampled": sampled})
        finally:
            service.shutdown()
    return answers
