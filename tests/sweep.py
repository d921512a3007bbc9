"""Mutation sweep: disable each rule in turn in a copy of the tree; the unit suite must fail each time.

`python -m tests.sweep [NAME ...]` (or `make sweep`) prints one line per mutation: killed (a test failed,
and the first failure) or SURVIVED (no test noticed the rule was gone). Slow: about 20 minutes on 2 cores.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import time

SRC = pathlib.Path(__file__).resolve().parent.parent
M = [
 ("S1 volume", "webhook/core/rules.py", "if _is_publish_volume(name):  # S1", "if False:  # S1"),
 ("S1 mount", "webhook/core/rules.py", 'if _is_publish_volume(mount.get("name")):  # S1', 'if False:  # S1'),
 ("S2", "webhook/core/rules.py", "if paths.under_publish_dir(mount_path):  # S2", "if False:  # S2"),
 ("S2 look-alike", "webhook/core/rules.py", "elif paths.looks_under_publish_dir(mount_path):  # S2, look-alikes", "elif False:"),
 ("S3 trainer", "webhook/core/rules.py", "        if _is_reserved_env(name):  # S3\n", "        if False:  # S3\n"),
 ("S3 entry", "webhook/core/rules.py", "if _is_reserved_env(name):  # S3, for patched containers too", "if False:"),
 ("S4 differs", "webhook/core/admission.py", 'def _s4(p: Plan, reasons: Reasons) -> None:\n', 'def _s4(p: Plan, reasons: Reasons) -> None:\n    return\n'),
 ("S4 duplicate", "webhook/core/rules.py", 'reasons.add(ErrInvalid, f"spec.runtimePatches[{i}].manager", f"{manager!r} appears more than once", "S4")', 'pass'),
 ("S4 unconfigured", "webhook/core/admission.py", "            if p.own is not None:\n                reasons.extend(_s4_unconfigured(p))", "            pass"),
 ("S5", "webhook/core/admission.py", "if p.readable:  # S5", "if False:  # S5"),
 ("S6 volume", "webhook/core/rules.py", "if _looks_like(name, cred.name):  # S6", "if False:  # S6"),
 ("S6 mount", "webhook/core/rules.py", "for cred in creds:  # S6: Trainer merges mounts by path", "for cred in ():"),
 ("R1 group", "webhook/core/rules.py", "if group_ok and group != GROUP:", "if False:"),
 ("R1 kind", "webhook/core/rules.py", "if kind_ok and kind not in KINDS:", "if False:"),
 ("R1 empty string", "webhook/core/rules.py", "group = GROUP if group is None else group", "group = GROUP if not group else group"),
 ("R2", "webhook/core/rules.py", '    """R2."""\n', '    """R2."""\n    return\n'),
 ("R3", "webhook/core/rules.py", "if not targets:  # R3", "if False:  # R3"),
 ("R4", "webhook/core/rules.py", "if publish is not None and publish.via == ROUTE_INIT_CONTAINER:  # R4", "if False:"),
 ("R5 volume", "webhook/core/rules.py", 'if vol.get("name") in reserved:', "if False:"),
 ("R5 mount", "webhook/core/rules.py", "if isinstance(mp, str) and paths.under_publish_dir(mp):", "if False:"),
 ("R6", "webhook/core/rules.py", "and not facts.policies & set(PROC_POLICIES):  # R6", "and False:"),
 ("R6 old rule", "webhook/core/rules.py", "and not facts.policies & set(PROC_POLICIES):  # R6", "and not facts.torch:"),
 ("R7", "webhook/core/rules.py", "if facts.torch:  # R7", "if False:"),
 ("R8", "webhook/core/rules.py", "if count + 1 > MAX_RUNTIME_PATCHES:", "if False:"),
 ("6.3 immutable", "webhook/core/admission.py", "if not patch.same(p.own.entry, p.old_own.entry):", "if False:"),
 ("6.3 removed (validate)", "webhook/core/admission.py", 'f"the entry of manager {p.manager!r} was removed; it is immutable once written", RULE_UPDATE)', 'f"x", RULE_UPDATE) if False else None'),
 ("6.3 put back", "webhook/core/admission.py", "ops.append(patch.insert_op(p.spec, p.old_own.index, json.dumps(p.old_own.entry)))", "pass"),
 ("6.3 deleting", "webhook/core/admission.py", 'if old is not None and (meta.get("deletionTimestamp") or _meta(old).get("deletionTimestamp")):', "if False:"),
 ("6.3 spec unchanged (validate)", "webhook/core/admission.py", "if p.stage is Stage.DELETING or p.spec_same:", "if p.stage is Stage.DELETING:"),
 ("6.3 spec unchanged (mutate)", "webhook/core/admission.py", "    if p.spec_same:  # labels", "    if False:  # labels"),
 ("6.3 suspend of running job", "webhook/core/admission.py", "Stage.ADD if _suspended(old_spec) else Stage.RUNNING", "Stage.ADD if _suspended(old_spec) or _suspended(spec) else Stage.RUNNING"),
 ("6.3 only entry added", "webhook/core/admission.py", "    if p.only_entry_added:  # judged", "    if False:  # judged"),
 ("6.2 replace pre-seeded", "webhook/core/admission.py", "ops.append(patch.replace_op(p.own.index, p.entry.json(p.time)))", "pass"),
 ("8.1 warn", "webhook/core/admission.py", "if not decision.reasons or enforcement is Enforcement.ENFORCE:", "if True:"),
 ("8.1 count on validate", "webhook/core/admission.py", "if verb is Verb.VALIDATE else ()", "if verb is not None else ()"),
 ("8.3 runtime warnings", "webhook/core/admission.py", "        if self.settings.configured:\n            # Judged", "        if False:\n            # Judged"),
 ("4 bound", "webhook/core/errors.py", "if len(reasons) <= MAX_CAUSES:", "if True:"),
 ("4 dedupe", "webhook/core/errors.py", "if key not in self._seen:", "if True:"),
 ("4 fault keeps reasons", "webhook/core/admission.py", "entry = _guarded(runtime_reasons, self._runtime,", "entry = (lambda f, *a: f(*a))(self._runtime,"),
 ("2 unknown key", "webhook/core/settings.py", '        "additionalProperties": False,\n        "properties": {\n            "manager"', '        "properties": {\n            "manager"'),
 ("2 duplicate key", "webhook/core/settings.py", 'reasons.add(ErrInvalid, _join(where, dup), "duplicate key")', "pass"),
 ("2 null", "webhook/core/settings.py", 'reasons.add(ErrInvalid, where or "(document)", "null is not allowed: it would read as unset and take the default")', "pass"),
 ("2 wrong type", "webhook/core/settings.py", 'reasons.add(ErrInvalid, where, f"must be {err.validator_value}, not {_json_type(err.instance)}", RULE_SETTINGS)', "pass"),
 ("2 not an object", "webhook/core/settings.py", 'reasons.add(ErrInvalid, "(document)", f"must be a JSON object, not {_json_type(doc)}")', "return _build({})"),
 ("2 trailing data", "webhook/core/settings.py", 'what = "trailing data after the document" if e.msg == "Extra data" else e.msg', 'return json.loads(text[:e.pos], object_pairs_hook=_object_pairs)'),
 ("2 tag image", "webhook/core/images.py", 'PINNED_PATTERN = rf"^{_NAME}@{DIGEST_PATTERN}$"', 'PINNED_PATTERN = rf"^{_NAME}(:[\\w.-]+)?@{DIGEST_PATTERN}$"'),
 ("2 digest length", "webhook/core/images.py", 'DIGEST_PATTERN = r"sha256:[0-9a-f]{64}"', 'DIGEST_PATTERN = r"sha256:[0-9a-f]{63,65}"'),
 ("2 ipv6", "webhook/core/images.py", '|{_IPV6})(?::[0-9]+)?"', ')(?::[0-9]+)?"'),
 ("2 initContainer under route 1", "webhook/core/settings.py", '"initContainer": {"required": ["via"], "properties": {"via": {"const": ROUTE_INIT_CONTAINER}}}', '"initContainer": {}'),
 ("2 credential overlaps publish", "webhook/core/settings.py", "if paths.overlaps(mount, paths.PUBLISH_DIR):", "if False:"),
 ("2 credentials overlap", "webhook/core/settings.py", 'if creds[j]["mountPath"] is not None and paths.overlaps(mount, creds[j]["mountPath"]):', "if False:"),
 ("2 duplicate credential name", "webhook/core/settings.py", "if name in seen_names:", "if False:"),
 ("2 credential named dispatch-publish", "webhook/core/settings.py", '"not": {"const": PUBLISH_VOLUME},', ""),
 ("2 control characters", "webhook/core/settings.py", "elif isinstance(value, str) and _CONTROL.search(value):", "elif False:"),
 ("3 normalise", "webhook/core/paths.py", 'return posixpath.normpath("/" + path.lstrip("/"))', "return path"),
]
only = sys.argv[1:]
work = pathlib.Path(f"/tmp/sweep-{os.getpid()}")
results = []
for name, f, old, new in M:
    if only and not any(o in name for o in only):
        continue
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(SRC, work, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".hypothesis", "certs"), symlinks=True)
    p = work / f
    text = p.read_text()
    if text.count(old) != 1:
        results.append((name, f"MUTATION NOT APPLIED ({text.count(old)} matches)")); print(results[-1], flush=True); continue
    p.write_text(text.replace(old, new))
    t = time.monotonic()
    r = subprocess.run([str(SRC / ".venv/bin/python"), "-m", "pytest", "tests/unit", "-x", "-q", "-p", "no:cacheprovider",
                        "--ignore=tests/unit/test_dockerfile.py", "--ignore=tests/unit/test_certs.py", "--ignore=tests/unit/test_layers.py"],
                       cwd=work, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "CI": "1"})
    last = [l for l in r.stdout.splitlines() if l.startswith(("FAILED", "ERROR")) or " passed" in l or " failed" in l or " error" in l] or [r.stdout[-300:] + r.stderr[-300:]]
    verdict = "killed" if r.returncode != 0 else "SURVIVED"
    results.append((name, verdict, f"{time.monotonic()-t:.0f}s", last[:1]))
    print(results[-1], flush=True)
shutil.rmtree(work, ignore_errors=True)
survived = [r for r in results if r[1] != "killed"]
print(f"{len(results) - len(survived)} of {len(results)} mutations killed")
sys.exit(1 if survived else 0)
