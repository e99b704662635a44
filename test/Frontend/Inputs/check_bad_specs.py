"""Runs the catalogue of invalid specs (bad-specs.jsonl) through `tessel
compile --emit-only` and checks that each one is refused cleanly.

Each line of the catalogue is one JSON object (lines starting with `#` and
blank lines are skipped):

  id       a short name for reports (default: the line number)
  base     the example spec the case starts from (default gpt-tiny.json)
  spec     a whole spec object, written to the case's file instead
  file     the file's text, verbatim (broken JSON, ...)
  file_py  a Python expression giving the file's text (str, or bytes for
           invalid UTF-8): a huge string, deep nesting, ...
  name     the name of the file written (default spec.json)
  set      --set overrides, e.g. ["model.heads=5"]
  set_py   a Python expression giving the --set overrides (a huge value)
  args     other command-line arguments, e.g. ["--dp", "0"]
  expect   what stderr must contain: the field path and the reason
  exit     the exit status expected (default 1; 2 is a command-line error)

A case passes when the command exits with exactly that status (not a
signal), stderr holds `expect`, starts with the tool's error line, quotes the
input briefly (under 1500 bytes) and shows no crash (LLVM ERROR, Stack dump,
an uncaught exception, a sanitizer report, the JSON library's tags), nothing
is printed as compiled, and the case's directory holds nothing but its input:
no output directory and no staging directory (OUT.tmp-PID) is left.

  check_bad_specs.py --tessel tessel --examples DIR --cases FILE --work DIR
                     [--jobs N] [--min-cases N] [--only ID]
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

CRASH_SIGNS = [
    "LLVM ERROR",
    "Stack dump",
    "PLEASE submit",
    "terminate called",
    "Assertion",
    "AddressSanitizer",
    "runtime error:",
    "Segmentation fault",
    "core dumped",
    "json.exception",
    "Traceback",
]
MAX_STDERR = 1500


def load_cases(path):
    cases = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                case = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit("%s:%d: not a JSON object: %s" % (path, number, e))
            case.setdefault("id", "line%d" % number)
            case["line"] = number
            if "expect" not in case:
                sys.exit("%s:%d: no 'expect'" % (path, number))
            cases.append(case)
    ids = [c["id"] for c in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        sys.exit("%s: ids given twice: %s" % (path, ", ".join(duplicates)))
    return cases


def evaluate(expression):
    return eval(expression, {"__builtins__": {}},
                {"chr": chr, "bytes": bytes, "range": range, "str": str,
                 "json": json})


def file_bytes(case, examples):
    if "file_py" in case:
        text = evaluate(case["file_py"])
    elif "file" in case:
        text = case["file"]
    elif "spec" in case:
        text = json.dumps(case["spec"])
    else:
        with open(os.path.join(examples, case.get("base", "gpt-tiny.json")),
                  "rb") as f:
            return f.read()
    return text if isinstance(text, bytes) else text.encode("utf-8")


def run_case(case, args):
    work = os.path.join(args.work, case["id"])
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    name = case.get("name", "spec.json")
    spec = os.path.join(work, name)
    with open(spec, "wb") as f:
        f.write(file_bytes(case, args.examples))
    command = [args.tessel, "compile", spec, "-o", os.path.join(work, "out"),
               "--emit-only"]
    sets = case.get("set", [])
    if "set_py" in case:
        sets = sets + evaluate(case["set_py"])
    for assignment in sets:
        command += ["--set", assignment]
    command += case.get("args", [])
    # Lone surrogates in the catalogue (\udcff) become single bytes (0xff):
    # arguments that are not UTF-8.
    command = [os.fsencode(a) for a in command]
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, timeout=120,
                              cwd=work)
    except subprocess.TimeoutExpired:
        return ["did not finish in 120 s"], 120.0
    seconds = time.monotonic() - start
    err = done.stderr.decode("utf-8", "replace")
    out = done.stdout.decode("utf-8", "replace")
    problems = []
    expected = case.get("exit", 1)
    if done.returncode < 0:
        problems.append("killed by signal %d" % -done.returncode)
    elif done.returncode != expected:
        problems.append("exit status %d, expected %d" %
                        (done.returncode, expected))
    if case["expect"] not in err:
        problems.append("stderr lacks %r" % case["expect"])
    lead = "tessel: error: " if expected == 1 else "tessel compile: "
    if not err.startswith(lead):
        problems.append("stderr does not start with %r" % lead)
    for sign in CRASH_SIGNS:
        if sign in err:
            problems.append("stderr shows %r" % sign)
    if len(done.stderr) > case.get("max_stderr", MAX_STDERR):
        problems.append("stderr is %d bytes long" % len(done.stderr))
    if "compiled" in out:
        problems.append("stdout says it compiled")
    left = sorted(set(os.listdir(work)) - {name})
    if left:
        problems.append("left behind: %s" % ", ".join(left))
    if problems:
        problems.append("stderr: " + err[:800].rstrip())
    return problems, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessel", required=True)
    parser.add_argument("--examples", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--min-cases", type=int, default=0)
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--slowest", type=int, default=0,
                        help="print the N slowest cases")
    args = parser.parse_args()

    # Cases run in their own directories: the tool found now, on PATH or
    # as given.
    tessel = shutil.which(args.tessel)
    if not tessel:
        sys.exit("cannot find %s" % args.tessel)
    args.tessel = os.path.abspath(tessel)
    args.examples = os.path.abspath(args.examples)
    args.work = os.path.abspath(args.work)
    cases = load_cases(args.cases)
    if len(cases) < args.min_cases:
        sys.exit("%s: %d cases, fewer than %d" %
                 (args.cases, len(cases), args.min_cases))
    if args.only:
        cases = [c for c in cases if c["id"] in args.only]
    os.makedirs(args.work, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: (c, run_case(c, args)), cases))
    failed = 0
    for case, (problems, _) in results:
        if problems:
            failed += 1
            print("FAIL %s (%s:%d)" % (case["id"], os.path.basename(args.cases),
                                        case["line"]))
            for p in problems:
                print("  " + p.replace("\n", "\n  "))
    if args.slowest:
        for case, (_, seconds) in sorted(results, key=lambda r: -r[1][1])[
                :args.slowest]:
            print("%6.2f s  %s" % (seconds, case["id"]))
    print("bad-specs: %d cases, %d refused as expected, %d failed" %
          (len(results), len(results) - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
