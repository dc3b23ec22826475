"""A picture of TensorBoard's trace viewer on a run's profile, taken with headless Chromium.

    apt-get install chromium; pip install websocket-client tensorboard-plugin-profile
    python -m experiments.trace_screenshot WORKDIR --out trace_viewer.png

Starts `tensorboard --logdir WORKDIR`, opens the Profile plugin's trace viewer on the
newest trace (the page TensorBoard's Profile tab frames), expands every process through
the Chrome DevTools protocol, waits for the events to draw and saves a screenshot.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from experiments import tensorboard_server


class DevTools:
    """The Chrome DevTools protocol over one page's websocket."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=120)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                return reply.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir")
    p.add_argument("--out", default="trace_viewer.png")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--find", default="", help="search the trace for this (e.g. train)")
    args = p.parse_args(argv)

    tensorboard, base = tensorboard_server.start(args.workdir)
    cdp_port = tensorboard_server.free_port()
    profile_dir = tempfile.mkdtemp(prefix="chromium_")
    chromium = subprocess.Popen(
        [
            shutil.which("chromium") or "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--remote-debugging-port={cdp_port}",
            f"--user-data-dir={profile_dir}",
            f"--window-size={args.width},{args.height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        get_json = tensorboard_server.get_json
        runs = get_json(f"{base}/data/plugin/profile/runs")
        run = sorted(runs)[-1]
        host = get_json(f"{base}/data/plugin/profile/hosts?run={run}&tag=trace_viewer@")[0]
        host = host["hostname"]
        data = f"/data/plugin/profile/data?run={run}&tag=trace_viewer@&host={host}"
        page = (
            f"{base}/data/plugin/profile/trace_viewer_index.html?is_streaming=true"
            f"&is_oss=true&trace_data_url={urllib.parse.quote(data, safe='')}"
        )
        targets = json.loads(tensorboard_server.wait_for(f"http://127.0.0.1:{cdp_port}/json"))
        tab = next(t for t in targets if t["type"] == "page")
        tools = DevTools(tab["webSocketDebuggerUrl"])
        tools.call("Page.enable")
        tools.call("Page.navigate", url=page)
        time.sleep(15)  # the page loads the trace and draws it
        # Expand every process (the viewer opens them collapsed): a click on its button.
        rect = tools.evaluate(
            "(() => { const b = document.getElementById('expand_all_button');"
            " return b && JSON.stringify(b.getBoundingClientRect()); })()"
        )
        clicked = rect is not None
        if clicked:
            box = json.loads(rect)
            x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            for kind in ("mousePressed", "mouseReleased"):
                tools.call(
                    "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
                )
        time.sleep(5)
        if args.find:  # the viewer's own search: it selects the first match, in view
            box = json.loads(
                tools.evaluate(
                    "JSON.stringify(document.querySelector('tr-ui-find-control input')"
                    " .getBoundingClientRect())"
                )
                or "null"
            )
            if box:
                x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
                for kind in ("mousePressed", "mouseReleased"):
                    tools.call(
                        "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
                    )
                tools.call("Input.insertText", text=args.find)
                for kind in ("keyDown", "keyUp"):
                    tools.call(
                        "Input.dispatchKeyEvent",
                        type=kind,
                        key="Enter",
                        code="Enter",
                        windowsVirtualKeyCode=13,
                    )
                time.sleep(3)
        shot = tools.call("Page.captureScreenshot", format="png")
        Path(args.out).write_bytes(base64.b64decode(shot["data"]))
        print(
            f"{args.out}: trace viewer of run {run} (host {host}), processes expanded: "
            f"{bool(clicked)}"
        )
    finally:
        chromium.kill()
        tensorboard.kill()
        shutil.rmtree(profile_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
