"""Drives the ART kernel headless through jupyter_client, as a notebook front end would.

Run: ART_KERNEL_BIN=target/debug/art-kernel python tests/kernel/test_kernel.py [--start-up]
(`cargo test -p art-kernel` runs it with the interpreter named by ART_TEST_PYTHON; `--start-up`
measures the start-up alone, without the tests.)

The kernelspec is installed into a temporary prefix; the build cache is the kernel's usual one
(ART_KERNEL_CACHE or ~/.cache/art-kernel), so a cold machine spends minutes in the install step.

Before the tests it starts the kernel three times as a user would (start, `1 + 1`, a cell defining
a variable, one using it, a first `.await?` cell, a restart) and prints the median of each, with
`python -m ipykernel`'s ready time measured in the same run as the reference a notebook user
compares against. Times are printed, not asserted (BENCHMARKS.md keeps them).
"""

import base64
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import unittest

from jupyter_client.manager import KernelManager

KERNEL_BIN = os.environ.get("ART_KERNEL_BIN", "target/debug/art-kernel")
TIMINGS = {}


def timed(name, seconds):
    TIMINGS.setdefault(name, []).append(seconds)


class Kernel:
    """One kernel for the whole run (starting one is the slow part)."""

    def __init__(self):
        self.prefix = tempfile.mkdtemp(prefix="art-kernel-test-")
        started = time.monotonic()
        subprocess.run([KERNEL_BIN, "install", "--prefix", self.prefix], check=True)
        timed("install (warms the cache)", time.monotonic() - started)
        os.environ["JUPYTER_PATH"] = os.path.join(self.prefix, "share", "jupyter")
        measure_start_up()
        self.km = KernelManager(kernel_name="art")
        self.log = tempfile.TemporaryFile(mode="w+")
        self.km.start_kernel(stderr=self.log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=300)

    def run(self, code, timeout=120, on_output=None):
        return run_cell(self.kc, code, timeout, on_output)

    def collect(self, msg_id, timeout=120, on_output=None):
        return collect(self.kc, msg_id, timeout, on_output)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        shutil.rmtree(self.prefix, ignore_errors=True)


def run_cell(kc, code, timeout=120, on_output=None):
    """Executes `code`; returns the execute_reply and the iopub messages of this request."""
    msg_id = kc.execute(code)
    return collect(kc, msg_id, timeout, on_output)


def collect(kc, msg_id, timeout=120, on_output=None):
    """The execute_reply and the iopub messages of request `msg_id`, once the kernel is idle."""
    outputs = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no idle status for {msg_id} within {timeout}s; saw {outputs}")
        try:
            message = kc.get_iopub_msg(timeout=remaining)
        except queue.Empty:
            continue
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        kind = message["msg_type"]
        if kind == "status" and message["content"]["execution_state"] == "idle":
            break
        if kind not in ("status", "execute_input"):
            outputs.append(message)
            if on_output:
                on_output(message)
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply, outputs


def wait_for_line(log, text, count, timeout=300):
    """Waits until the kernel's log (a file it writes stderr to) holds `count` lines with `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        if log.read().count(text) >= count:
            return
        time.sleep(0.02)
    log.seek(0)
    raise AssertionError(f"no {count}x {text!r} in the kernel's log:\n{log.read()}")


def timed_cell(kc, label, code, expect=None):
    started = time.monotonic()
    reply, outputs = run_cell(kc, code, timeout=300)
    timed(label, time.monotonic() - started)
    assert reply["content"]["status"] == "ok", (code, reply["content"], outputs)
    if expect is not None:
        shown = of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"]
        assert shown == expect, (code, shown)


START_UP = [
    "ready: prelude done",
    "first `1 + 1`",
    "first cell defining a variable",
    "a cell using it",
    "first `.await?` cell",
    "restart to ready",
]


def measure_start_up(starts=3):
    """Starts the kernel as a user would, `starts` times, each cell sent as soon as the last one
    answered; then `python -m ipykernel` the same number of times."""
    for _ in range(starts):
        log = tempfile.TemporaryFile(mode="w+")
        km = KernelManager(kernel_name="art")
        started = time.monotonic()
        km.start_kernel(stderr=log)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=300)
        wait_for_line(log, "prelude done", 1)
        timed(START_UP[0], time.monotonic() - started)
        timed_cell(kc, START_UP[1], "1 + 1", "2")
        timed_cell(kc, START_UP[2], "let answer = 40;")
        timed_cell(kc, START_UP[3], "answer + 2", "42")
        timed_cell(kc, START_UP[4],
                   'tokio::time::sleep(std::time::Duration::from_millis(1)).await;\n'
                   '"7".parse::<u32>()?', "7")
        started = time.monotonic()
        km.restart_kernel(now=False)
        wait_for_line(log, "prelude done", 2)
        timed(START_UP[5], time.monotonic() - started)
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    for _ in range(starts):
        km = KernelManager(kernel_name="python3")
        started = time.monotonic()
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        timed("ipykernel: ready (kernel_info answered)", time.monotonic() - started)
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def start_up_summary():
    """The medians of measure_start_up's figures, and ours / ipykernel's ready time."""
    median = lambda name: statistics.median(TIMINGS[name])
    lines = [f"  {name}: {median(name):.2f}" for name in START_UP if name in TIMINGS]
    python = "ipykernel: ready (kernel_info answered)"
    if python in TIMINGS and START_UP[0] in TIMINGS:
        lines.append(f"  {python}: {median(python):.2f}")
        lines.append(f"  ready, ours / ipykernel's: {median(START_UP[0]) / median(python):.2f}x")
    return "\n".join(lines)


@contextlib.contextmanager
def own_kernel(env=None):
    """A kernel of the test's own (not the shared one), ready; shut down when the block ends."""
    km = KernelManager(kernel_name="art")
    km.start_kernel(**({} if env is None else {"env": env}))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=300)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


KERNEL = None


def kernel():
    global KERNEL
    if KERNEL is None:
        KERNEL = Kernel()
    return KERNEL


def of_type(outputs, kind):
    return [o for o in outputs if o["msg_type"] == kind]


def text_of(outputs):
    return "".join(o["content"]["text"] for o in of_type(outputs, "stream"))


class KernelTest(unittest.TestCase):
    def test_01_evaluates_an_expression(self):
        k = kernel()
        for attempt in range(3):
            started = time.monotonic()
            reply, outputs = k.run("1 + 1")
            timed("simple cell `1 + 1`", time.monotonic() - started)
            self.assertEqual(reply["content"]["status"], "ok", reply["content"])
            results = of_type(outputs, "execute_result")
            self.assertEqual(len(results), 1, outputs)
            self.assertEqual(results[0]["content"]["data"]["text/plain"], "2")

    def test_02_variables_persist_and_print(self):
        k = kernel()
        started = time.monotonic()
        reply, _ = k.run("let answer = 40;")
        timed("first cell defining a variable", time.monotonic() - started)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        started = time.monotonic()
        reply, outputs = k.run('println!("hello from rust"); answer + 2')
        timed("cell using a variable", time.monotonic() - started)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        self.assertIn("hello from rust", text_of(outputs))
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "42")

    def test_03_rich_outputs_with_mime_types(self):
        k = kernel()
        code = r'''
display::html("<b>bold</b>");
display::svg(r#"<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>"#);
display::png(vec![0x89u8, b'P', b'N', b'G', 13, 10, 26, 10]);
display::markdown("*hi*");
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        shown = of_type(outputs, "display_data")
        self.assertEqual(len(shown), 4, outputs)
        self.assertEqual(shown[0]["content"]["data"]["text/html"], "<b>bold</b>")
        self.assertIn("<svg", shown[1]["content"]["data"]["image/svg+xml"])
        self.assertEqual(shown[2]["content"]["data"]["image/png"], "iVBORw0KGgo=")
        self.assertEqual(shown[3]["content"]["data"]["text/markdown"], "*hi*")

    def test_04_live_display_updates_in_place(self):
        k = kernel()
        code = r'''
let live = Display::new();
for step in 0..3 {
    live.update(display::Html(format!("step {step}")));
}
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        shown = of_type(outputs, "display_data")
        updates = of_type(outputs, "update_display_data")
        self.assertEqual(len(shown), 1, outputs)
        self.assertEqual(len(updates), 2, outputs)
        display_id = shown[0]["content"]["transient"]["display_id"]
        self.assertTrue(display_id)
        for update in updates:
            self.assertEqual(update["content"]["transient"]["display_id"], display_id)
        self.assertEqual(updates[-1]["content"]["data"]["text/html"], "step 2")

    def test_05_trajectory_renders_as_html(self):
        k = kernel()
        code = r'''
let mut t = Trajectory::new([Message::system("You are terse."), Message::user("2+2?")]);
t.push_message(Message::assistant("4"));
t.reward = 1.0;
t.set_metric("correct", true);
t
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        data = of_type(outputs, "execute_result")[0]["content"]["data"]
        self.assertIn("art-root", data["text/html"])
        self.assertIn("correct", data["text/html"])
        self.assertIn("[assistant] 4", data["text/plain"])

    def test_06_gather_shows_live_progress(self):
        k = kernel()
        code = r'''
let groups = gather_trajectory_groups(
    (0..2).map(|g| TrajectoryGroup::from_rollouts((0..4).map(move |i| async move {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let mut t = Trajectory::new([Message::user("q")]);
        t.push_message(Message::assistant(format!("answer {i}")));
        t.reward = (g * 4 + i) as f64 / 8.0;
        Ok::<_, std::io::Error>(t)
    }))),
    GatherOptions::new().concurrency(2),
).await.unwrap();
groups[1].clone()
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        shown = of_type(outputs, "display_data")
        updates = of_type(outputs, "update_display_data")
        self.assertEqual(len(shown), 1, outputs)
        self.assertGreaterEqual(len(updates), 2, outputs)
        final = updates[-1]["content"]["data"]["text/plain"]
        self.assertIn("8/8 rollouts", final)
        self.assertIn("2/2 groups", final)
        result = of_type(outputs, "execute_result")[0]["content"]["data"]
        self.assertIn("TrajectoryGroup: 4 trajectories", result["text/plain"])
        self.assertIn("art-cols", result["text/html"])

    def test_07_compile_error_is_an_error_output(self):
        k = kernel()
        reply, outputs = k.run('let x: i32 = "not a number";')
        self.assertEqual(reply["content"]["status"], "error")
        errors = of_type(outputs, "error")
        self.assertEqual(len(errors), 1, outputs)
        error = errors[0]["content"]
        self.assertEqual(error["ename"], "CompileError")
        self.assertIn("mismatched types", error["evalue"])
        self.assertTrue(any("^" in line for line in error["traceback"]), error["traceback"])
        # The kernel goes on.
        reply, outputs = k.run("3 * 3")
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "9")

    def test_08_completion(self):
        k = kernel()
        code = "let numbers = vec![1, 2, 3];\nnumbers.it"
        # While rust-analyzer is still busy with its first question, completions answer with
        # nothing after a short wait (a cell is never held up behind them); ask again as a
        # user pressing Tab again would.
        deadline = time.monotonic() + 120
        while True:
            started = time.monotonic()
            msg_id = k.kc.complete(code, len(code))
            reply = k.kc.get_shell_msg(timeout=60)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = k.kc.get_shell_msg(timeout=60)
            self.assertLess(time.monotonic() - started, 10, "a completion must not block")
            if reply["content"]["matches"] or time.monotonic() > deadline:
                break
            time.sleep(1)
        timed("completion", time.monotonic() - started)
        content = reply["content"]
        self.assertEqual(content["status"], "ok", content)
        self.assertTrue(any(m.startswith("iter") for m in content["matches"]), content["matches"][:20])
        self.assertEqual(content["cursor_end"], len(code))
        self.assertEqual(content["cursor_start"], len(code) - 2)

    def test_09_is_complete(self):
        k = kernel()
        msg_id = k.kc.is_complete("fn f() {")
        reply = k.kc.get_shell_msg(timeout=30)
        self.assertEqual(reply["content"]["status"], "incomplete")
        k.kc.is_complete("1 + 1")
        reply = k.kc.get_shell_msg(timeout=30)
        self.assertEqual(reply["content"]["status"], "complete")

    def _interrupt_a_loop(self, interrupt):
        k = kernel()
        code = r'''
println!("looping");
loop { std::thread::sleep(std::time::Duration::from_millis(10)); }
'''
        msg_id = k.kc.execute(code)
        looping = time.monotonic() + 120
        seen = []
        # Wait until the loop runs (the cell has compiled and printed), then interrupt.
        while time.monotonic() < looping:
            message = k.kc.get_iopub_msg(timeout=120)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            seen.append(message)
            if message["msg_type"] == "stream" and "looping" in message["content"]["text"]:
                break
        time.sleep(0.3)
        started = time.monotonic()
        interrupt()
        reply, outputs = k.collect(msg_id, timeout=30)
        timed("interrupt to reply", time.monotonic() - started)
        self.assertEqual(reply["content"]["status"], "error", reply["content"])
        self.assertEqual(reply["content"]["ename"], "Interrupted")
        # The kernel lives on and runs the next cell.
        reply, outputs = k.run("1 + 2")
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "3")

    def test_10_interrupt_by_signal(self):
        k = kernel()
        # What JupyterLab's stop button does for interrupt_mode "signal": SIGINT to the group.
        self._interrupt_a_loop(k.km.interrupt_kernel)

    def test_11_interrupt_by_message(self):
        k = kernel()

        def interrupt_request():
            k.kc.control_channel.send(k.kc.session.msg("interrupt_request", {}))
            reply = k.kc.control_channel.get_msg(timeout=10)
            self.assertEqual(reply["msg_type"], "interrupt_reply")

        self._interrupt_a_loop(interrupt_request)

    def test_12_several_outputs_and_stream_order(self):
        k = kernel()
        code = r'''
println!("one");
display::html("<i>two</i>");
println!("three");
"four"
'''
        reply, outputs = k.run(code)
        kinds = [o["msg_type"] for o in outputs]
        self.assertEqual(kinds, ["stream", "display_data", "stream", "execute_result"], outputs)

    def test_13_training_view_draws_curves_in_place(self):
        k = kernel()
        code = r'''
let view = display::TrainingView::new("GRPO");
for step in 1..=3u64 {
    let mut hook = view.hook();
    for micro_batch in 0..=2 {
        hook(&TrainProgress {
            step, micro_batch, micro_batches: 2, trainable_tokens: micro_batch * 8,
            total_trainable_tokens: 16, loss: 0.1, elapsed_s: 0.0,
        });
    }
    view.record_step(step, step as f64 / 3.0, 0.5 / step as f64);
}
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        shown = of_type(outputs, "display_data")
        updates = of_type(outputs, "update_display_data")
        self.assertEqual(len(shown), 1, outputs)
        self.assertGreaterEqual(len(updates), 5, outputs)
        final = updates[-1]["content"]["data"]
        self.assertEqual(final["text/plain"], "GRPO: step 3, reward 1 (first 0.333), loss 0.167")
        # The curves are images (data URLs), which untrusted notebooks still show.
        charts = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', final["text/html"])
        self.assertEqual(len(charts), 2)
        svgs = [base64.b64decode(c).decode() for c in charts]
        self.assertEqual(sum(svg.count("<circle") for svg in svgs), 6)

    def test_14_frames_and_charts_show_as_cell_results(self):
        k = kernel()
        code = r'''
let group = TrajectoryGroup::new((0..3).map(|i| {
    let mut t = Trajectory::new([Message::user("2+2?")]);
    t.push_message(Message::assistant(format!("{}", 3 + i)));
    t.reward = if i == 1 { 1.0 } else { 0.0 };
    t
}));
let table = groups_frame(&[group.clone()]).unwrap();
display::show(&table);
plots::reward_distribution_chart(&[group.clone()])
'''
        reply, outputs = k.run(code)
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        table = of_type(outputs, "display_data")[0]["content"]["data"]
        self.assertIn("art-table", table["text/html"])
        self.assertIn("3 rows &times;", table["text/html"])
        self.assertIn("reward", table["text/plain"])
        result = of_type(outputs, "execute_result")[0]["content"]
        chart = result["data"]
        # The PNG has twice the pixels; the result's metadata says the size to show it at.
        self.assertGreater(result["metadata"]["image/png"]["width"], 0, result["metadata"])
        self.assertNotIn("application/vnd.art.result-metadata+json", chart)
        self.assertIn("image/svg+xml", chart, chart)
        self.assertIn("<svg", chart["image/svg+xml"])
        # And a PNG for front ends that do not show SVG (JupyterLab, untrusted).
        self.assertTrue(base64.b64decode(chart["image/png"]).startswith(b"\x89PNG"))

    def test_15_a_failed_question_mark_is_an_error(self):
        k = kernel()
        reply, outputs = k.run('let n: i32 = "x7".parse()?;\nprintln!("not reached {n}");')
        self.assertEqual(reply["content"]["status"], "error", outputs)
        errors = of_type(outputs, "error")
        self.assertEqual(len(errors), 1, outputs)
        self.assertIn("`?`", errors[0]["content"]["evalue"])
        self.assertIn("invalid digit", text_of(outputs))
        self.assertNotIn("not reached", text_of(outputs))
        self.assertNotIn("ART_KERNEL_CELL_FAILED", text_of(outputs))
        # The next cell is fine again.
        reply, outputs = k.run('let m: i32 = "7".parse()?;\nm')
        self.assertEqual(reply["content"]["status"], "ok", outputs)
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "7")

    def test_16_plain_results_compile_once_and_rich_ones_stay_rich(self):
        k = kernel()

        def result(code):
            k.run(":timing")  # on: the cell's phases go to stderr
            reply, outputs = k.run(code)
            k.run(":timing")  # off
            self.assertEqual(reply["content"]["status"], "ok", outputs)
            return of_type(outputs, "execute_result")[0]["content"]["data"], text_of(outputs)

        # An expression without a rich view: Debug text, compiled once (no "Fallback" phase).
        data, log = result("vec![1, 2].len() + 1")
        self.assertEqual(data["text/plain"], "3")
        self.assertNotIn("Fallback", log)
        data, _ = result('String::from("x")')
        self.assertEqual(data["text/plain"], '"x"')
        # A bare variable not declared `mut`, defined in an earlier cell or in the same one.
        k.run('let plain_word = String::from("y");')
        data, _ = result("plain_word")
        self.assertEqual(data["text/plain"], '"y"')
        data, log = result('let same_cell = 7;\nsame_cell')
        self.assertEqual(data["text/plain"], "7")
        self.assertNotIn("Fallback", log)
        # Rich values keep their view, through references and boxes too.
        k.run('let shown = vec![Trajectory::new([Message::user("hi")])];')
        for code in ["shown[0].clone()", "shown.first().unwrap()", "Box::new(shown[0].clone())"]:
            data, _ = result(code)
            self.assertIn("text/html", data, code)

    def test_17_a_variable_that_cannot_be_kept_is_explained(self):
        k = kernel()
        # A closure runs in its own cell; its type cannot be named, so it is not kept.
        reply, _ = k.run("let add_one = |x: i32| x + 1;\nadd_one(1)")
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        # The next cell that uses it waits for the analysis, then says why it is gone (also
        # when that cell then fails to compile for want of it).
        reply, outputs = k.run("add_one(2)", timeout=300)
        self.assertEqual(reply["content"]["status"], "error", outputs)
        self.assertIn("`add_one` is a closure", text_of(outputs))
        self.assertIn("Box<dyn Fn()>", text_of(outputs))
        # Boxed, as the note says, it is kept.
        k.run("let add_two: Box<dyn Fn(i32) -> i32> = Box::new(|x| x + 2);")
        reply, outputs = k.run("add_two(1)")
        self.assertEqual(reply["content"]["status"], "ok", outputs)
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "3")

    def test_18_a_cells_rollouts_nest_under_its_span(self):
        # With traces on (the OTEL_* variables in the kernel's environment), each cell is a span
        # of the kernel, and what the cell runs (gather_trajectory_groups here) joins it.
        folder = tempfile.mkdtemp(prefix="art-kernel-otlp-")
        spans_path = os.path.join(folder, "spans.jsonl")
        receiver = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "..", "observability", "otlp_receiver.py"),
             spans_path], stdout=subprocess.PIPE, text=True)
        port = int(receiver.stdout.readline().split()[1])
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                   OTEL_BSP_SCHEDULE_DELAY="100",
                   ART_TENSORBOARD_BIN=os.path.join(os.path.dirname(sys.executable), "tensorboard"))
        try:
            with own_kernel(env) as kc:
                reply, outputs = run_cell(kc, (
                    "let groups = gather_trajectory_groups((0..2).map(|_| TrajectoryGroup::from_rollouts(\n"
                    "    (0..2).map(|i| async move { let mut t = Trajectory::new([Message::user(\"hi\")]);\n"
                    "        t.reward = i as f64; Ok::<_, std::io::Error>(t) }))), GatherOptions::new()).await?;\n"
                    "groups.len()"), timeout=300)
                self.assertEqual(reply["content"]["status"], "ok", outputs)
                spans = []
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if os.path.exists(spans_path):
                        with open(spans_path) as f:
                            spans = [json.loads(line) for line in f]
                    names = {s["name"] for s in spans}
                    if {"cell", "gather_trajectory_groups"} <= names:
                        break
                    time.sleep(0.2)
                cells = [s for s in spans if s["name"] == "cell" and "gather_trajectory_groups" in
                         s["attributes"].get("art.cell.code", "")]
                gathers = [s for s in spans if s["name"] == "gather_trajectory_groups"]
                self.assertEqual(len(cells), 1, spans)
                self.assertEqual(len(gathers), 1, spans)
                self.assertEqual(cells[0]["service"], "art-kernel")
                self.assertEqual(gathers[0]["parent_span_id"], cells[0]["span_id"])
                self.assertEqual(gathers[0]["trace_id"], cells[0]["trace_id"])
                groups = [s for s in spans if s["name"] == "trajectory_group"]
                self.assertEqual(len(groups), 2)

                # TensorBoard inline: started by one cell, found again by a later one, stopped with
                # the kernel.
                urls = []
                for _ in range(2):
                    reply, outputs = run_cell(kc, f'display::tensorboard("{folder}")?', timeout=180)
                    self.assertEqual(reply["content"]["status"], "ok", outputs)
                    html = of_type(outputs, "execute_result")[0]["content"]["data"]["text/html"]
                    urls.append(re.search(r'src="([^"]+)"', html).group(1))
                self.assertEqual(urls[0], urls[1])
        finally:
            receiver.kill()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and subprocess.run(
                    ["pgrep", "-f", f"--logdir {folder}"], capture_output=True).returncode == 0:
                time.sleep(0.2)
            left = subprocess.run(["pgrep", "-af", f"--logdir {folder}"], capture_output=True, text=True)
            shutil.rmtree(folder, ignore_errors=True)
        self.assertEqual(left.stdout, "", "TensorBoard outlived its kernel")

    def test_19_variables_are_used_before_their_types_are_analysed(self):
        # In a fresh kernel the first analysis takes seconds; meanwhile a cell using variables
        # gets their types from what the child reported at run time (evcxr patch 0011): paths
        # through private modules (art_core::types::trajectory::Trajectory), std's internals
        # (HashMap), the cell's own items. Their values must come through whole.
        with own_kernel() as kc:
            reply, outputs = run_cell(kc, (
                'let t = Trajectory::new([Message::user("hi")]);\n'
                "let groups = vec![TrajectoryGroup::new([t.clone()])];\n"
                "let config = TrainConfig::default();\n"
                "let mut scores = std::collections::HashMap::<String, f64>::new();\n"
                'scores.insert("a".into(), 0.5);\n'
                "struct Point { x: i32 }\n"
                "let p = Point { x: 3 };\n"
                "let maybe = Some(1.5f64);"), timeout=300)
            self.assertEqual(reply["content"]["status"], "ok", outputs)
            reply, outputs = run_cell(kc, (
                'format!("{} {} {} {} {} {:?}", t.messages().len(), groups.len(), '
                "config.learning_rate, scores[\"a\"], p.x, maybe)"), timeout=300)
            self.assertEqual(reply["content"]["status"], "ok", outputs)
            self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"],
                             '"1 1 0.000005 0.5 3 Some(1.5)"')
            reply, outputs = run_cell(kc, 'scores.insert("b".into(), 1.0);\nscores.len() + groups.len()')
            self.assertEqual(reply["content"]["status"], "ok", outputs)
            self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "3")

    def test_20_a_dep_links_beside_the_toolkit(self):
        # A crate added with `:dep` is linked into the cell beside the toolkit's shared library
        # (art-cell-deps), and the toolkit still works in the same cell. `half` is in cargo's
        # local cache (the workspace uses it); on a fresh machine its target-specific dependency
        # `crunchy` is not, so the kernel, which builds offline, retries the `:dep` online.
        k = kernel()
        reply, outputs = k.run(':dep half = "2"', timeout=300)
        self.assertEqual(reply["content"]["status"], "ok", outputs)
        reply, outputs = k.run(
            'let t = Trajectory::new([Message::user("hi")]);\n'
            "half::f16::from_f32(1.5).to_f32() + t.messages().len() as f32", timeout=300)
        self.assertEqual(reply["content"]["status"], "ok", outputs)
        self.assertEqual(of_type(outputs, "execute_result")[0]["content"]["data"]["text/plain"], "2.5")


def main():
    if not os.path.exists(KERNEL_BIN):
        print(f"no kernel binary at {KERNEL_BIN}", file=sys.stderr)
        return 2
    if sys.argv[1:] == ["--start-up"]:
        # The start-up figures alone (BENCHMARKS.md, "Notebook kernel"): install, three starts.
        prefix = tempfile.mkdtemp(prefix="art-kernel-bench-")
        subprocess.run([KERNEL_BIN, "install", "--prefix", prefix], check=True)
        os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
        measure_start_up()
        shutil.rmtree(prefix, ignore_errors=True)
        print("Start-up, median of 3 starts (seconds):")
        print(start_up_summary())
        return 0
    suite = unittest.TestLoader().loadTestsFromTestCase(KernelTest)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    if KERNEL is not None:
        KERNEL.close()
    print(f"\nStart-up, median of {len(TIMINGS.get(START_UP[0], []))} starts (seconds):")
    print(start_up_summary())
    print("\nTimings (seconds):")
    for name, values in TIMINGS.items():
        print(f"  {name}: " + ", ".join(f"{v:.2f}" for v in values))
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
