"""Screenshots of the main window in light and dark, for a human look.

PNGs go to the test's temporary directory and, when it can be written, to
/tmp/expertdesk-screens/ as well.
"""

from __future__ import annotations

from pathlib import Path

from app.history import ChatSettings, HistoryStore, default_history_path
from gui_helpers import gui_env, open_window, send_and_wait, set_sampling  # noqa: F401 (fixtures)

SHARED_DIR = Path("/tmp/expertdesk-screens")

QUESTION = "How do I read a JSON file in Python and print it nicely?"
ANSWER = """Use the standard library's `json` module: `json.load` reads a file object, and
`json.dumps` with `indent` formats it.

```python
import json
from pathlib import Path

def show(path: str) -> None:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    print(json.dumps(data, indent=2, sort_keys=True))
```

- `indent=2` puts each key on its own line
- `sort_keys=True` makes the output stable between runs

| function | reads from |
|---|---|
| `json.load` | a file object |
| `json.loads` | a string |
"""
REASONING = "The user wants to load and pretty-print JSON. json.load plus json.dumps(indent=2) covers it."
STATS = {"prompt_tokens": 31, "completion_tokens": 142, "ttft_s": 0.84, "prefill_tok_s": 212.0,
         "decode_tok_s": 11.6, "hit_rate": 0.91, "ssd_gb_per_token": 0.183, "stop_reason": "eos"}


def _seed_history() -> None:
    history = HistoryStore(default_history_path())
    older = history.create_conversation("Explain MoE expert caching")
    history.add_message(older.id, "user", "Why does an expert cache help MoE models?")
    conversation = history.create_conversation(settings=ChatSettings(system_prompt="Answer with short examples."),
                                               model_ref="demo")
    history.add_message(conversation.id, "user", QUESTION)
    reply = history.add_message(conversation.id, "assistant", "", status="streaming", model_ref="demo")
    history.update_message(reply.id, content=ANSWER, reasoning=REASONING, status="finished", stats=STATS)
    history.close()


def test_screenshots_light_and_dark(qtbot, open_window, tmp_path):
    _seed_history()
    window = open_window()
    window.resize(1280, 800)
    assert window.chat_view.widgets[0].content == QUESTION
    set_sampling(window, max_tokens=24)
    send_and_wait(qtbot, window, "And what does json.dumps do with non-ASCII text?")
    qtbot.wait(300)  # one more snapshot for the charts

    try:
        SHARED_DIR.mkdir(parents=True, exist_ok=True)
        targets = [tmp_path, SHARED_DIR]
    except OSError:
        targets = [tmp_path]
    written = []
    for theme in ("light", "dark"):
        window.set_theme(theme)
        window.chat_view.scroll_to_bottom()
        qtbot.wait(150)
        image = window.grab()
        assert image.width() >= 1000 and image.height() >= 700
        for folder in targets:
            path = folder / f"main-window-{theme}.png"
            assert image.save(str(path)), f"could not write {path}"
            written.append(path)
    window.set_theme("system")
    for path in written:
        assert path.stat().st_size > 20_000
    # The dark shot really is dark, the light one light (sampled from the window background).
    light = _mean_brightness(tmp_path / "main-window-light.png")
    dark = _mean_brightness(tmp_path / "main-window-dark.png")
    assert light > 170 > 90 > dark


def _mean_brightness(path: Path) -> float:
    from PySide6.QtGui import QImage

    image = QImage(str(path))
    total, count = 0, 0
    for x in range(0, image.width(), 37):
        for y in range(0, image.height(), 37):
            color = image.pixelColor(x, y)
            total += (color.red() + color.green() + color.blue()) / 3
            count += 1
    return total / count
