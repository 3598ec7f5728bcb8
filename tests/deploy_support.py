"""What tests/test_deploy.py needs to check deploy/ without a cluster or a container daemon.

- :func:`assemble`: the subset of kustomize that deploy/kubernetes uses (resources, namespace,
  configMapGenerator with files and labels, generatorOptions without name hashes, images,
  RFC 6902 patches). Any other kustomization field is an error here, so the manifests
  cannot start using one that this assembly would silently ignore; where kubectl's built-in
  kustomize exists, the test compares the two outputs.
- :func:`strict_model`: a manifest read into the ``kubernetes`` client's model for its kind,
  refusing any key the model does not define, at every depth, and any value of the wrong
  type (the client's own deserializer drops unknown keys silently).
"""

from __future__ import annotations

import copy
import datetime
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

__all__ = ["assemble", "strict_model", "json_patch", "unit_file", "env_expand"]

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator", "generatorOptions",
                       "images", "patches"}


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, ``replace`` and ``remove`` (what the overlays use); a path whose
    parent does not exist is an error, as in kustomize."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        kind = op["op"]
        if kind not in ("add", "replace", "remove"):
            raise ValueError(f"JSON patch op {kind!r} is not supported here")
        if isinstance(node, list):
            if kind == "add":
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[int(last)] = copy.deepcopy(op["value"])
            else:
                del node[int(last)]
        else:
            if kind in ("replace", "remove") and last not in node:
                raise KeyError(f"{op['path']}: nothing to {kind}")
            if kind == "remove":
                del node[last]
            else:
                node[last] = copy.deepcopy(op["value"])
    return doc


def assemble(root: Path) -> list[dict[str, Any]]:
    """The documents ``kustomize build root`` gives, for the features listed above."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{root}: kustomization fields this assembly does not implement: {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        p = root / res
        docs += assemble(p) if p.is_dir() else _load_all(p)
    options = k.get("generatorOptions", {})
    if k.get("configMapGenerator") and options.get("disableNameSuffixHash") is not True:
        raise ValueError(f"{root}: generated names with hash suffixes are not implemented here")
    for gen in k.get("configMapGenerator", []):
        labels = {**options.get("labels", {}), **gen.get("options", {}).get("labels", {})}
        meta: dict[str, Any] = {"name": gen["name"]}
        if labels:
            meta["labels"] = labels
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                     "data": {Path(f).name: (root / f).read_text() for f in gen["files"]}})
    for patch in k.get("patches", []):
        target, ops = patch["target"], yaml.safe_load((root / patch["path"]).read_text())
        hits = [i for i, d in enumerate(docs) if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        if len(hits) != 1:
            raise ValueError(f"{root}: patch {patch['path']} matches {len(hits)} documents")
        docs[hits[0]] = json_patch(docs[hits[0]], ops)
    for image in k.get("images", []):
        for d in docs:
            for c in _containers(d):
                name, _, _tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    if "namespace" in k:
        for d in docs:
            d["metadata"]["namespace"] = k["namespace"]
    return docs


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def _model_name(doc: dict[str, Any]) -> str:
    version = doc["apiVersion"].split("/")[-1]
    return version[0].upper() + version[1:] + doc["kind"]


def strict_model(doc: dict[str, Any]) -> Any:
    """``doc`` as its ``kubernetes.client`` model; ``ValueError`` naming the path of the first
    key the model lacks or value of the wrong type, or a required field that is missing."""
    import kubernetes.client as k8s

    name = _model_name(doc)
    cls = getattr(k8s, name, None)
    if cls is None:
        raise ValueError(f"no kubernetes client model {name} for {doc['apiVersion']} {doc['kind']}")
    _check(doc, name, doc["kind"])

    class _Response:  # ApiClient.deserialize reads .data, as it does an HTTP response's
        data = json.dumps(doc)

    return k8s.ApiClient().deserialize(_Response(), name)  # required fields: ValueError


_PRIMITIVES = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "object": (object,),
               "datetime": (str, datetime.datetime), "date": (str, datetime.date)}


def _check(value: Any, type_name: str, where: str) -> None:
    import kubernetes.client as k8s

    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        for i, v in enumerate(value):
            _check(v, m.group(1), f"{where}[{i}]")
        return
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a map, got {value!r}")
        for key, v in value.items():
            _check(v, m.group(1), f"{where}.{key}")
        return
    if type_name in _PRIMITIVES:
        if not isinstance(value, _PRIMITIVES[type_name]) or (type_name == "int" and isinstance(value, bool)):
            raise ValueError(f"{where}: expected {type_name}, got {value!r}")
        return
    cls = getattr(k8s, type_name)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a {type_name} object, got {value!r}")
    by_json = {j: a for a, j in cls.attribute_map.items()}
    for key, v in value.items():
        if key not in by_json:
            raise ValueError(f"{where}: unknown field {key!r} ({type_name} has {sorted(by_json)})")
        _check(v, cls.openapi_types[by_json[key]], f"{where}.{key}")


def env_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in ``args`` (an undefined variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def unit_file(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit's sections as ``{section: [(key, value), ...]}`` (keys repeat; ``\\``
    continuations joined; comments dropped). Raises ``ValueError`` on a line that is none
    of these."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = iter(text.splitlines())
    for line in lines:
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines)
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[([A-Za-z]+)\]", stripped):
            current = sections.setdefault(m.group(1), [])
            continue
        if current is None or "=" not in stripped:
            raise ValueError(f"not a unit file line: {line!r}")
        key, _, value = stripped.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def exec_argv(value: str) -> list[str]:
    """``ExecStart=``'s command line as systemd splits it (no prefixes used here)."""
    return shlex.split(value)
