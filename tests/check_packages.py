#!/usr/bin/python3
"""Checks that scripts/run installs every Debian package r2ccl uses.

A machine where everything is installed hides a missing install step: the build finds a package
that was installed by hand, and a fresh machine then fails. This check looks at what the
configured build really uses and asks dpkg which package each file belongs to:

  * every dependency cmake/Dependencies.cmake found (r2ccl-dependencies.tsv): the file that
    proved it must belong to the Debian package named there, or to one that package pulls in;
  * every file CMake's cache points at (compilers, pkg-config libraries, CMake package folders);
  * every header the compiler read (ninja's dependency log) and every library the build links;
  * every program the scripts and tests start, and the Python modules they import
    (`scripts/run programs COMMAND`).

Each file's package must be in the list `scripts/run` installs for the command that needs it,
or be installed as a dependency of one in that list (Depends and Pre-Depends, recursively;
Recommends do not count, since scripts/run installs with --no-install-recommends), or be part of
every Debian system (Essential or Priority required, what debootstrap's minbase has). A file that
no package owns fails too, except the optional CUDA toolkit, which comes from NVIDIA.

usage: tests/check_packages.py SOURCE_DIR BUILD_DIR
Exit status 0 when everything is covered, 1 with one line per problem otherwise, 77 (skipped)
where there is no dpkg.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Files that no Debian package owns and that are allowed: NVIDIA's CUDA toolkit (optional).
NOT_FROM_DEBIAN = ("/usr/local/cuda",)
DEBIAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# Commands whose packages `scripts/run test` does not install: what is missing is reported, not
# failed (CI cannot check them without installing them).
OPTIONAL_COMMANDS = ("collbench", "soak", "servebench", "servebench-engine", "pd-ttft", "simplots", "vllm-test")
# Build-only scripts/run commands: their list must cover the build (headers, libraries, CMake).
BUILD_COMMAND = "build"


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def scripts_run_list(source: Path, what: str, command: str) -> list[str]:
    r = run([str(source / "scripts" / "run"), what, command])
    if r.returncode != 0:
        sys.exit(f"check_packages: `scripts/run {what} {command}` failed: {r.stderr.strip()}")
    return r.stdout.split()


def base_system() -> list[str]:
    """The packages every Debian system has (Essential, or Priority required: debootstrap's minbase)."""
    r = run(["dpkg-query", "-W", "-f=${Package} ${Essential} ${Priority}\n"])
    out = []
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 2 and ("yes" in f[1:] or "required" in f[1:]):
            out.append(f[0])
    return out


def closure(packages: list[str]) -> set[str]:
    """The installed packages that `packages` pull in through Depends/Pre-Depends, and themselves."""
    r = run(["apt-cache", "depends", "--recurse", "--installed", "--no-recommends",
             "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances",
             *packages])
    if r.returncode != 0:
        sys.exit(f"check_packages: apt-cache depends failed: {r.stderr.strip()}")
    names = set()
    for line in r.stdout.splitlines():
        if line and not line[0].isspace():
            names.add(line.strip().split(":")[0])  # "libfoo:amd64" -> "libfoo"
    return names


def alternatives(path: str) -> list[str]:
    """`path` as given, resolved, and with /usr merged or not (dpkg records the path it shipped)."""
    out = [path]
    real = os.path.realpath(path)
    if real != path:
        out.append(real)
    for p in list(out):
        for a, b in (("/usr/lib/", "/lib/"), ("/usr/bin/", "/bin/"), ("/usr/sbin/", "/sbin/")):
            if p.startswith(a):
                out.append(b + p[len(a):])
            elif p.startswith(b):
                out.append(a + p[len(b):])
    return list(dict.fromkeys(out))


def owners(paths: list[str]) -> dict[str, set[str]]:
    """dpkg's owning packages of each path (an empty set where no package owns it)."""
    result: dict[str, set[str]] = {p: set() for p in paths}
    todo = {p: alternatives(p) for p in paths}
    for attempt in range(4):
        ask = sorted({alts[attempt] for p, alts in todo.items()
                      if not result[p] and attempt < len(alts)})
        if not ask:
            break
        found: dict[str, set[str]] = {}
        for i in range(0, len(ask), 500):
            r = run(["dpkg-query", "-S", *ask[i:i + 500]])
            for line in r.stdout.splitlines():
                pkgs, sep, path = line.partition(": ")
                if sep and path.startswith("/"):
                    found.setdefault(path, set()).update(
                        p.strip().split(":")[0] for p in pkgs.split(","))
        for p, alts in todo.items():
            if not result[p] and attempt < len(alts) and alts[attempt] in found:
                result[p] = found[alts[attempt]]
    return result


def cache_files(build: Path) -> dict[str, str]:
    """Files CMake's cache points at: FILEPATH entries and the folders of CMake packages."""
    out = {}
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.+-]+):(FILEPATH|PATH)=(/.+)$", line)
        if not m:
            continue
        name, kind, value = m.groups()
        if kind == "PATH" and not name.endswith("_DIR"):
            continue  # install prefixes and the like, not something found
        if os.path.exists(value):
            out[value] = f"CMake cache {name}"
    return out


def manifest(build: Path) -> list[tuple[str, str, str]]:
    rows = []
    path = build / "r2ccl-dependencies.tsv"
    if not path.exists():
        sys.exit(f"check_packages: {path} is missing (configure with cmake/Dependencies.cmake)")
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, debian, proof = (line.split("\t") + ["", ""])[:3]
        rows.append((name, debian, proof))
    return rows


def headers(build: Path) -> dict[str, str]:
    """Every header outside the source and build trees that the compiler read (ninja's deps log)."""
    r = run(["ninja", "-C", str(build), "-t", "deps"])
    if r.returncode != 0:
        sys.exit(f"check_packages: ninja -t deps failed: {r.stderr.strip()}")
    out = {}
    for line in r.stdout.splitlines():
        p = line.strip()
        if p.startswith("/usr/") or p.startswith("/lib") or p.startswith("/opt/"):
            out.setdefault(os.path.normpath(p), "a header the build includes")
    if not out:
        sys.exit("check_packages: ninja's dependency log names no system header (build first)")
    return out


def libraries(build: Path) -> dict[str, str]:
    """Every library the build links: absolute paths and -lNAME, as the linker would find them."""
    text = (build / "build.ninja").read_text()
    out = {}
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("LINK_LIBRARIES = "):
            continue
        for tok in line[len("LINK_LIBRARIES = "):].split():
            if tok.startswith("/") and re.search(r"\.(so|a)(\.[0-9.]+)?$", tok):
                out.setdefault(tok, "a library the build links")
            elif tok.startswith("-l") and len(tok) > 2:
                names.add(tok[2:])
    cxx = shutil.which("c++") or "c++"
    for n in sorted(names):
        r = run([cxx, f"-print-file-name=lib{n}.so"])
        p = r.stdout.strip()
        if p.startswith("/") and os.path.exists(p):
            out.setdefault(os.path.normpath(p), f"-l{n}, linked by the build")
    return out


def programs(source: Path, command: str) -> dict[str, str]:
    out = {}
    problems = []
    for prog in scripts_run_list(source, "programs", command):
        if prog.startswith("py:"):
            mod = prog[3:]
            r = run(["/usr/bin/python3", "-c", f"import {mod}; print({mod}.__file__)"])
            if r.returncode != 0 or not r.stdout.strip().startswith("/"):
                if command in OPTIONAL_COMMANDS:
                    print(f"check_packages: not checked: the Python module '{mod}' for "
                          f"`scripts/run {command}` is not installed here")
                    continue
                problems.append(f"the Python module '{mod}' (for `scripts/run {command}`) does "
                                f"not import in /usr/bin/python3")
                continue
            out[r.stdout.strip()] = f"Python module {mod}"
            continue
        # Where Debian's packages put programs (not /usr/local, pyenv and the like).
        path = shutil.which(prog, path=DEBIAN_PATH)
        if path is None:
            if command in OPTIONAL_COMMANDS:
                print(f"check_packages: not checked: the program '{prog}' for "
                      f"`scripts/run {command}` is not installed here")
                continue
            problems.append(f"the program '{prog}' (for `scripts/run {command}`) is not "
                            f"installed in {DEBIAN_PATH}")
            continue
        out[path] = f"the program {prog}"
    return out, problems


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    source, build = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    for tool in ("dpkg-query", "apt-cache"):
        if shutil.which(tool) is None:
            print(f"SKIP: check_packages needs {tool}: this is not a Debian system")
            return 77
    problems: list[str] = []
    # What each scripts/run command installs, and everything those packages pull in.
    commands = ("build", "test", "collbench", "soak", "servebench", "servebench-engine", "pd-ttft", "simplots", "vllm-test")
    lists = {c: scripts_run_list(source, "packages", c) for c in commands}
    base = base_system()
    covered = {c: closure(lists[c] + base) for c in commands}

    # (file, why, command whose list must cover it)
    wanted: list[tuple[str, str, str]] = []
    for f, why in headers(build).items():
        wanted.append((f, why, BUILD_COMMAND))
    for f, why in libraries(build).items():
        wanted.append((f, why, BUILD_COMMAND))
    for f, why in cache_files(build).items():
        # Libraries, CMake packages and the compilers are the build's; the cache also holds
        # programs only the tests run (clang-format, /usr/bin/python3), which the list of
        # `scripts/run test` (it configures the same tree) must cover.
        name = why.split()[-1]
        own_build = name.startswith(("pkgcfg_lib_", "CMAKE_")) or name.endswith("_DIR")
        wanted.append((f, why, BUILD_COMMAND if own_build else "test"))
    rows = manifest(build)
    for name, debian, proof in rows:
        if not proof:
            problems.append(f"dependency {name}: CMake found it but recorded no file to check")
            continue
        wanted.append((proof, f"dependency {name} (cmake/Dependencies.cmake)", BUILD_COMMAND))
    for command in ("test", "collbench", "soak", "servebench", "servebench-engine", "pd-ttft", "simplots", "vllm-test"):
        progs, why_not = programs(source, command)
        problems += why_not
        wanted += [(f, why, command) for f, why in progs.items()]
    build_progs, why_not = programs(source, BUILD_COMMAND)
    problems += why_not
    wanted += [(f, why, BUILD_COMMAND) for f, why in build_progs.items()]

    own = owners(sorted({f for f, _, _ in wanted}))
    seen = set()
    for f, why, command in wanted:
        pkgs = own.get(f, set())
        if not pkgs:
            if f.startswith(NOT_FROM_DEBIAN) or os.path.realpath(f).startswith(NOT_FROM_DEBIAN):
                continue
            key = ("orphan", f)
            if key not in seen:
                seen.add(key)
                problems.append(f"{f} ({why}) belongs to no Debian package: scripts/run cannot "
                                f"install it on a fresh machine")
            continue
        if pkgs & covered[command]:
            continue
        pkg = sorted(pkgs)[0]
        key = (pkg, command)
        if key in seen:
            continue
        seen.add(key)
        problems.append(
            f"the Debian package '{pkg}' is used but `scripts/run {command}` does not install "
            f"it, nor any package that depends on it: {f} ({why}). Add {pkg} to scripts/run's "
            f"list for '{command}'.")

    # The packages Dependencies.cmake names in its errors must be the ones that hold the files.
    for name, debian, proof in rows:
        pkgs = own.get(proof, set())
        if pkgs and debian not in pkgs and not (pkgs & closure([debian])):
            problems.append(f"cmake/Dependencies.cmake names '{debian}' for {name}, but {proof} "
                            f"belongs to {', '.join(sorted(pkgs))}")
        if debian not in covered[BUILD_COMMAND]:
            problems.append(f"cmake/Dependencies.cmake needs '{debian}' for {name}, but "
                            f"`scripts/run {BUILD_COMMAND}` does not install it")

    checked = len({f for f, _, _ in wanted})
    if problems:
        for p in problems:
            print(f"check_packages: {p}")
        print(f"check_packages: FAILED ({len(problems)} problem(s), {checked} files checked)")
        return 1
    print(f"check_packages: OK: {checked} files (headers, libraries, CMake and pkg-config files, "
          f"programs) all come from packages that scripts/run installs "
          f"({', '.join(f'{c}: {len(lists[c])}' for c in commands)} listed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
