"""MkDocs hook: one API reference page per public tapehook module that exists in the code.

The pages are generated, not kept in docs/, so a module that is added (tapehook.zoo,
tapehook.distill) gets its page in the next build without anyone writing it, and a
module that does not exist yet asks for no page. mkdocstrings renders each page from
the docstrings; with `strict: true` a docstring that does not render fails the build.
"""

import ast
import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tapehook"
# Packages documented in full even though tapehook/__init__.py does not import them
# (importing tapehook.larq, say, is the user's choice).
EXTRA_MODULES = ("larq", "zoo", "distill", "recipes", "config", "lite")


def _all_of(path):
    """The names in a module's __all__, or None without one. Besides literal strings,
    an element may unpack a literal tuple or list the module assigns to a name
    (`__all__ = [*MODELS, "f"]`)."""
    body = ast.parse(path.read_text()).body
    literals = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, (ast.List, ast.Tuple)):
                literals[target.id] = node.value
    if "__all__" not in literals:
        return None
    names = []
    for element in literals["__all__"].elts:
        if isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
            names += [ast.literal_eval(e) for e in literals[element.value.id].elts]
        else:
            names.append(ast.literal_eval(element))
    return names


def _module_path(name):
    package = PACKAGE / name / "__init__.py"
    return package if package.exists() else PACKAGE / f"{name}.py"


def _imported_modules(path):
    """Names a package imports as modules of itself (`from tapehook import layers`)."""
    return [
        alias.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module == "tapehook"
        for alias in node.names
    ]


def api_modules():
    """tapehook's public submodules that exist: those in tapehook.__all__, then the extras."""
    init = PACKAGE / "__init__.py"
    names = [n for n in _all_of(init) if n in _imported_modules(init)]
    names += [n for n in EXTRA_MODULES if n not in names and _module_path(n).exists()]
    return names


def _page(name):
    module = f"tapehook.{name}"
    lines = [f"# `{module}`", ""]
    path = _module_path(name)
    members = _all_of(path) or []
    submodules = [
        m for m in members if (path.parent / m).is_dir() or (path.parent / f"{m}.py").exists()
    ]
    if path.name == "__init__.py" and submodules:
        # A package whose __all__ names submodules (tapehook.larq): its docstring, then
        # each submodule's public names.
        lines += [f"::: {module}", "    options:", "      members: false", ""]
        for sub in submodules:
            lines += [f"::: {module}.{sub}", "    options:", "      heading_level: 2", ""]
    elif members:
        # The members named explicitly: griffe reads a literal __all__ by itself,
        # not one built by unpacking.
        lines += [f"::: {module}", "    options:", f"      members: {members}", ""]
    else:
        lines += [f"::: {module}", ""]
    return "\n".join(lines)


PAGES = {}


def on_config(config):
    PAGES.clear()
    PAGES["api/tapehook.md"] = "# `tapehook`\n\n::: tapehook\n"
    for name in api_modules():
        PAGES[f"api/{name}.md"] = _page(name)
    for section in config["nav"]:
        if isinstance(section, dict) and "API reference" in section:
            section["API reference"] = [
                {("tapehook" if p == "api/tapehook.md" else p[4:-3]): p} for p in PAGES
            ]
    return config


def on_files(files, config):
    for path, text in PAGES.items():
        files.append(File.generated(config, path, content=text))
    return files
