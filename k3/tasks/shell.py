"""The `shell` RL domain (the agentic one): file-system tasks done with tools
in a sandbox (k3/envs), judged by the end state of the files.

Each task is drawn from (seed, options, split, index) like the other domains (k3/tasks/domains.py):
a small initial file tree under the sandbox's home directory and one of three jobs:
- `create`: "Create NAME holding the line: TEXT";
- `count`: "Count lines with the word WORD under DIR/; write the number to FILE" (whole words, as
  `grep -w` matches them; a decoy file outside DIR holds WORD too);
- `rename`: "Rename every .txt file under DIR/ to .md (same name and content)." (a .txt outside DIR
  must stay).
Prompts stay under 80 characters (a tiny model's).
The level is the number of files the job touches (1 + level). Held-out tasks are the problems
whose canonical text (tree and job) hashes into the held-out share, as for arithmetic and strings.

Tools, declared in the JSON-schema shape of the tool domain's: `bash` (a shell command in the home
directory), `read_file` and `write_file` (paths relative to it). Every call runs in the episode's own
`Sandbox`, made from the task's initial tree (`ShellEpisode`); a bad call (unknown tool, arguments
that are not a JSON object, a missing argument, a failing read) gets an "error: ..." result, so the
model can retry. The reward judges a fork of the final sandbox (the episode's own tree stays as it
was): every file the job names must hold what it should (compared without trailing newlines),
every file it removes must be gone, and every other initial file must be unchanged; the last turn
must call no tool (the model says it is done).

Sandboxes come from one warm `SandboxPool` per process (k3/envs/pool.py: one base image, directories
and cgroups made up front; a closed episode's sandbox goes back to it, wiped); `configure(size,
**limits)` sets its size and limits (`k3 rl --sandboxes N --sandbox-memory-mb M`).

Episodes through the domain interface (`continue_with_tool_results`, `Task.verify`) keep their
sandbox between turns in a registry keyed by the task and the calls made so far, **paused** while
the episode waits for the model's next turn (partial rollout may leave it waiting for a whole
iteration): a paused sandbox holds no process and no cgroup, only its files. The next turn resumes
the same sandbox, so it continues from exactly the state the last calls left; `verify` judges and
closes it. A turn whose sandbox is not in the registry (a run resumed after a kill) replays the
episode's earlier calls in a fresh one, which gives the same state (the tasks' commands are
deterministic). `release(task_ids)` closes the sandboxes of episodes that never reached `verify`
(run_episodes does, also on errors); `release()` closes them all and the pool too (the end of a run).
"""
from __future__ import annotations

import io
import json
import random
import tarfile
import threading
from collections import defaultdict

from k3.tasks.default_set import WORDS

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the working directory; its output and exit code.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "The content of a file (a path relative to the working directory).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Create or replace a file with the given content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)
REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
RESULT_CHARS = 2000  # a tool result longer than this is cut (the model sees that it was)
EXEC_TIMEOUT_S = 10.0
KINDS = ("create", "count", "rename")
DIRS = ("docs", "notes", "logs", "data", "src", "mail")


class ShellUnavailable(RuntimeError):
    """The host cannot run the domain's sandboxes (the message says why, in one line)."""


def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))


def _text(rng: random.Random, lines: int) -> str:
    return "".join(_line(rng) + "\n" for _ in range(lines))


def draw(rng: random.Random, level: int) -> dict:
    """One problem: kind, prompt, initial files {path: text}, expected end state {path: text or None},
    the reference calls, and the canonical item text the split is decided on."""
    kind = rng.choice(KINDS)
    top, other = rng.sample(DIRS, 2)
    files = {f"{other}/{w}.log": _text(rng, rng.randint(1, 3)) for w in rng.sample(WORDS, 2)}
    if kind == "create":
        name = f"{top}/{rng.choice(WORDS)}.txt"
        text = " ".join(rng.sample(WORDS, 2 + level))
        for w in rng.sample(WORDS, level):
            path = f"{top}/{w}.md"
            files[path] = _text(rng, 2)
        prompt = f"Create {name} holding the line: {text}"
        expect = {name: text + "\n"}
        calls = [("write_file", {"path": name, "content": text + "\n"})]
    elif kind == "count":
        for i, w in enumerate(rng.sample(WORDS, 1 + level)):
            files[f"{top}/{'sub/' if i % 2 else ''}{w}.txt"] = _text(rng, rng.randint(2, 5))
        present = sorted({w for p, t in files.items() if p.startswith(top + "/") for w in t.split()})
        word = rng.choice(present) if rng.random() < 0.85 else rng.choice(WORDS)  # mostly a count above 0
        files[f"{other}/{word}.txt"] = f"{word} {word}\n"  # outside DIR: must not count
        out = f"{rng.choice(['count', 'result', 'answer', 'total'])}.txt"
        n = sum(1 for p, t in files.items() if p.startswith(top + "/") for ln in t.splitlines() if word in ln.split())
        prompt = f"Count lines with the word {word} under {top}/; write the number to {out}"
        expect = {out: f"{n}\n"}
        calls = [("bash", {"command": f"grep -rhw -- {word} {top} | wc -l > {out}"})]
    else:
        for i, w in enumerate(rng.sample(WORDS, 1 + level)):
            files[f"{top}/{'sub/' if i % 2 else ''}{w}.txt"] = _text(rng, 2)
        files[f"{top}/{rng.choice(WORDS)}.log"] = _text(rng, 1)
        files[f"{other}/{rng.choice(WORDS)}.txt"] = _text(rng, 1)  # outside DIR: must stay .txt
        prompt = f"Rename every .txt file under {top}/ to .md (same name and content)."
        expect = {}
        for p, t in files.items():
            if p.startswith(top + "/") and p.endswith(".txt"):
                expect[p] = None
                expect[p[:-4] + ".md"] = t
        calls = [("bash", {"command": f"find {top} -name '*.txt' -exec sh -c 'mv \"$1\" \"${{1%.txt}}.md\"' _ {{}} \\;"})]
    item = f"shell|{kind}|{json.dumps({'files': files, 'prompt': prompt}, sort_keys=True)}"
    return {"level": level, "kind": kind, "prompt": prompt, "files": files, "expect": expect, "calls": calls,
            "item": item, "answer": json.dumps(expect, sort_keys=True)}


def reference(parts: dict) -> list[dict]:
    """The reference episode: one assistant turn with the calls, their results, then "Done."."""
    calls = [{"id": f"functions.{name}:{k}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args)}}
             for k, (name, args) in enumerate(parts["calls"], 1)]
    out = [{"role": "assistant", "reasoning_content": _plan(parts), "content": None, "tool_calls": calls}]
    for call, (name, args) in zip(calls, parts["calls"]):
        result = f"wrote {len(args['content'].encode())} bytes to {args['path']}" if name == "write_file" \
            else "(no output)"
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    out.append({"role": "assistant", "content": "Done."})
    return out


def _plan(parts: dict) -> str:
    return {"create": "I write the file with the line.",
            "count": "grep -w finds the matching lines under the directory; wc counts them into the file.",
            "rename": "find each .txt under the directory and mv it to the same name with .md."}[parts["kind"]]


def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _untar(data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for m in tar.getmembers():
            if m.isfile():
                out[m.name.removeprefix("./")] = tar.extractfile(m).read()
    return out


def _clip(text: str) -> str:
    if len(text) <= RESULT_CHARS:
        return text
    return text[:RESULT_CHARS] + f"\n[output cut: {len(text) - RESULT_CHARS} more characters]"


def checked_arguments(name, arguments) -> dict | str:
    """A call's arguments as a dict, or the "error: ..." result of a call that cannot run."""
    if name not in TOOL_NAMES:
        return f"error: unknown tool {name!r} (tools: {', '.join(TOOL_NAMES)})"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"error: arguments are not valid JSON ({e.msg})"
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object"
    for key in REQUIRED[name]:
        if not isinstance(arguments.get(key), str):
            return f"error: {name} needs a string argument {key!r}"
    extra = sorted(set(arguments) - set(REQUIRED[name]))
    if extra:
        return f"error: {name} takes no argument {extra[0]!r} (arguments: {', '.join(REQUIRED[name])})"
    return arguments


_pool_lock = threading.Lock()
_pool = None  # the process's SandboxPool, made at the first episode
_pool_config: dict = {"size": 8, "limits": None}


def configure(size: int = 8, **limits) -> None:
    """The pool's size and k3.envs.Limits fields (the rest their defaults) for the episodes from now on."""
    from k3.envs import Limits, SandboxError
    if size < 1:
        raise ValueError(f"the sandbox pool needs at least 1 sandbox, got {size}")
    try:
        limits = Limits(**limits) if limits else None
    except SandboxError as e:
        raise ValueError(str(e)) from None
    global _pool
    with _pool_lock:
        old, _pool = (_pool, None) if {"size": size, "limits": limits} != _pool_config else (None, _pool)
        _pool_config.update(size=size, limits=limits)
    if old is not None:
        old.close()  # sandboxes still out are closed for good when their episodes end


def _acquire():
    """A warm sandbox from the pool (made on first use), on the bare base image."""
    from k3.envs import SandboxPool
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = SandboxPool(_pool_config["size"], _pool_config["limits"])
        return _pool.acquire()


def close_pool() -> None:
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


class ShellEpisode:
    """One episode's sandbox, made from a task's initial tree: runs the tool calls, judges a fork."""

    def __init__(self, task):
        from k3.envs import SandboxError
        self.task, self.sandbox = task, None
        try:
            self.sandbox = _acquire()
        except SandboxError as e:
            raise ShellUnavailable(f"shell domain: no sandbox on this host: {e}".splitlines()[0]) from None
        try:
            result = self.sandbox.exec(["tar", "-xf", "-"], stdin=_tar(task.setup["files"]))
            if not result.ok:
                raise RuntimeError(f"{task.id}: could not write the initial tree: {result.stderr[:200]!r}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, name, arguments) -> str:
        """One tool call's result for the model ("error: ..." for a bad call; never raises on one)."""
        from k3.envs import SandboxError
        arguments = checked_arguments(name, arguments)
        if isinstance(arguments, str):
            return arguments
        try:
            if name == "bash":
                return self._bash(arguments["command"])
            if name == "read_file":
                return _clip(self.sandbox.read_file(arguments["path"]).decode("utf-8", "replace"))
            data = arguments["content"].encode()
            self.sandbox.write_file(arguments["path"], data)
            return f"wrote {len(data)} bytes to {arguments['path']}"
        except SandboxError as e:
            return f"error: {e}"

    def _bash(self, command: str) -> str:
        if not command.strip() or "\0" in command:
            return "error: bash needs a non-empty command"
        r = self.sandbox.exec(command, timeout=EXEC_TIMEOUT_S)
        parts = []
        if r.stdout:
            parts.append(r.stdout.decode("utf-8", "replace").rstrip("\n"))
        if r.stderr:
            parts.append("stderr: " + r.stderr.decode("utf-8", "replace").rstrip("\n"))
        if r.killed_reason:
            parts.append(f"error: the command was stopped ({r.killed_reason})")
        elif r.code:
            parts.append(f"exit code {r.code}")
        return _clip("\n".join(parts)) or "(no output)"

    def run_calls(self, calls) -> list[str]:
        return [self.call((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in calls]

    def files(self, sandbox=None) -> dict[str, bytes]:
        """Every regular file under the home directory: {relative path: bytes}."""
        from k3.envs import SandboxError
        r = (sandbox or self.sandbox).exec(["tar", "-cf", "-", "."])
        if not r.ok or r.truncated:
            raise SandboxError(f"{self.task.id}: could not list the files: {r.killed_reason or r.stderr[:200]!r}")
        return _untar(r.stdout)

    def judge(self) -> str:
        """Why the end state is wrong ("" when it is right), read from a fork of the sandbox. A tree
        that cannot be read back (over the output cap, unreadable files) is wrong, not an error."""
        from k3.envs import SandboxError
        fork = self.sandbox.fork()
        try:
            return judge_files(self.task, self.files(fork))
        except SandboxError as e:
            return f"the end state could not be read: {e}".splitlines()[0]
        finally:
            fork.close()


def judge_files(task, files: dict[str, bytes]) -> str:
    expect = json.loads(task.answer)
    for path, want in sorted(expect.items()):
        have = files.get(path)
        if want is None:
            if have is not None:
                return f"{path} should be gone"
        elif have is None:
            return f"{path} is missing"
        elif have.decode("utf-8", "replace").rstrip("\n") != want.rstrip("\n"):
            return f"{path} holds {_clip(have.decode('utf-8', 'replace'))[:80]!r}, want {want.rstrip()!r}"
    for path, text in sorted(task.setup["files"].items()):
        if path not in expect and files.get(path) != text.encode():
            return f"{path} was changed or removed"
    return ""


# ---- episodes through the domain interface: sandboxes kept between turns, keyed by the calls so far

_lock = threading.Lock()
_live: dict[tuple[str, str], list[ShellEpisode]] = defaultdict(list)


def calls_key(task, calls) -> tuple[str, str]:
    canon = [[(c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")] for c in calls]
    return task.id, json.dumps(canon, sort_keys=True, default=str)


def take_episode(task, calls_so_far) -> ShellEpisode:
    """The live episode whose sandbox has run exactly `calls_so_far` (resumed), or a fresh one
    replaying them."""
    with _lock:
        waiting = _live.get(calls_key(task, calls_so_far))
        ep = waiting.pop() if waiting else None
    if ep is not None:
        try:
            ep.sandbox.resume()
        except BaseException:
            ep.close()
            raise
        return ep
    ep = ShellEpisode(task)
    try:
        ep.run_calls(calls_so_far)
    except BaseException:
        ep.close()
        raise
    return ep


def keep_episode(ep: ShellEpisode, calls_so_far) -> None:
    """Keep the episode's sandbox, paused, until its next turn (or verify) takes it."""
    try:
        ep.sandbox.pause()
    except BaseException:
        ep.close()
        raise
    with _lock:
        _live[calls_key(ep.task, calls_so_far)].append(ep)


def drop_episode(task, calls_so_far) -> None:
    """Close the live episode that ran `calls_so_far`, if one is kept (an episode ending unjudged)."""
    with _lock:
        waiting = _live.get(calls_key(task, calls_so_far))
        ep = waiting.pop() if waiting else None
    if ep is not None:
        ep.close()


def release(task_ids=None) -> int:
    """Close the kept sandboxes of these tasks' episodes (None: all, and the pool); how many were closed."""
    with _lock:
        keys = [k for k in _live if task_ids is None or k[0] in task_ids]
        eps = [ep for k in keys for ep in _live.pop(k)]
    try:
        for ep in eps:
            ep.close()
    finally:
        if task_ids is None:
            close_pool()
    return len(eps)


def paused_count() -> int:
    """How many kept episodes wait with their sandbox paused (all of them, between turns)."""
    with _lock:
        return sum(ep.sandbox.paused for v in _live.values() for ep in v)


def live_count() -> int:
    with _lock:
        return sum(len(v) for v in _live.values())
