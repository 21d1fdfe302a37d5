"""r2ccl as a NIXL backend: where its plugin is, and putting it where NIXL finds it.

    python -m r2ccl.nixl install     # beside NIXL's own plugins, in every NIXL wheel installed
    python -m r2ccl.nixl uninstall
    python -m r2ccl.nixl status      # what is installed where, and for which NIXL release
    python -m r2ccl.nixl path        # the plugin's own directory (for NIXL_PLUGIN_DIR)

NIXL finds backends as ``libplugin_<NAME>.so`` in one directory: ``NIXL_PLUGIN_DIR`` when it is
set, else the ``plugins`` directory beside its ``libnixl.so`` (in a pip install,
``site-packages/.nixl_cu12.mesonpy.libs/plugins``, and the same for cu13). ``install`` copies the
plugin there, so the backend ``R2CCL`` sits beside UCX and the others. Setting
``NIXL_PLUGIN_DIR`` to ``path``'s directory works too, but hides NIXL's bundled plugins (UCX
among them) from that process.

The plugin is built against one NIXL release's headers and refuses to load into another;
``install`` refuses a NIXL of another release, naming both.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

PLUGIN = "libplugin_R2CCL.so"
_NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")


def plugin_path() -> pathlib.Path:
    """The plugin this package carries (R2CCL_NIXL_PLUGIN names another)."""
    env = os.environ.get("R2CCL_NIXL_PLUGIN")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parent / "lib" / "nixl" / PLUGIN


def built_for(plugin: pathlib.Path | None = None) -> str:
    """The NIXL release the plugin was built for (written beside it at build time)."""
    plugin = plugin or plugin_path()
    marker = plugin.with_name(plugin.name + ".nixl-version")
    try:
        return marker.read_text().strip()
    except OSError as e:
        raise RuntimeError(
            f"r2ccl.nixl: {marker} is missing ({e.strerror}): the plugin cannot say which NIXL "
            "release it was built for; reinstall r2ccl"
        ) from None


def nixl_installs() -> list[tuple[str, str, pathlib.Path]]:
    """(package, version, plugin directory) of every NIXL wheel in this environment."""
    out = []
    for pkg in _NIXL_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        site = pathlib.Path(list(spec.submodule_search_locations)[0]).parent
        libs = site / f".{pkg}.mesonpy.libs"
        if not (libs / "libnixl.so").exists():
            continue
        try:
            version = importlib.metadata.version(pkg.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        out.append((pkg, version, libs / "plugins"))
    return out


def install(plugin: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Copies the plugin into every installed NIXL wheel's plugin directory; returns them."""
    plugin = plugin or plugin_path()
    if not plugin.is_file():
        raise RuntimeError(f"r2ccl.nixl: no plugin at {plugin}")
    want = built_for(plugin)
    installs = nixl_installs()
    if not installs:
        raise RuntimeError(
            f"r2ccl.nixl: no NIXL in this environment ({sys.prefix}); install it first: "
            f"pip install nixl=={want}"
        )
    wrong = [(pkg, v) for pkg, v, _ in installs if v != want]
    if wrong:
        names = ", ".join(f"{pkg} {v}" for pkg, v in wrong)
        raise RuntimeError(
            f"r2ccl.nixl: this plugin was built for NIXL {want}, and this environment has {names}; "
            f"install NIXL {want} (pip install nixl=={want}) or an r2ccl built for that release"
        )
    done = []
    for _, _, plugins in installs:
        plugins.mkdir(parents=True, exist_ok=True)
        # Copied beside, then renamed: a process loading plugins never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=plugins, prefix=".r2ccl-")
        os.close(fd)
        try:
            shutil.copyfile(plugin, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, plugins / PLUGIN)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        done.append(plugins / PLUGIN)
    return done


def uninstall() -> list[pathlib.Path]:
    removed = []
    for _, _, plugins in nixl_installs():
        target = plugins / PLUGIN
        if target.exists():
            target.unlink()
            removed.append(target)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m r2ccl.nixl", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["install", "uninstall", "status", "path"])
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            for p in install():
                print(f"installed {p}")
            print('NIXL now offers the backend "R2CCL" (vLLM: kv_connector_extra_config '
                  '{"backends": ["R2CCL"]}; SGLang: SGLANG_DISAGGREGATION_NIXL_BACKEND=R2CCL)')
        elif args.command == "uninstall":
            for p in uninstall():
                print(f"removed {p}")
        elif args.command == "path":
            print(plugin_path().parent)
        else:
            print(f"plugin: {plugin_path()} (built for NIXL {built_for()})")
            installs = nixl_installs()
            if not installs:
                print("NIXL: not installed in this environment")
            for pkg, version, plugins in installs:
                here = (plugins / PLUGIN).exists()
                print(f"{pkg} {version}: {plugins} ({'R2CCL installed' if here else 'no R2CCL'})")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
