"""Step 12 - constraints a grammar library would take and not enforce, found before it reads them.

llguidance compiles some constraints it cannot keep: a regular expression ending in a lone
backslash (the escape is dropped, so the text need not end as asked) and a JSON schema that no
finite value matches (a $ref that always leads back to itself, so the answer is cut by its
length, never by the grammar). `flaw` names why, in a sentence the server answers 400 with;
`LLGuidance.check` asks it before the library. The rest of what the library cannot enforce is
found by walking a new grammar along its first tokens (`LLGuidance.probe`), and a schema's
`patterns` each as a regular expression of its own (a pattern is a search: nothing forces an
answer's first tokens into it).
"""

import json

from tinyllm.core.sampling import Constraint


def flaw(c: Constraint) -> str | None:
    """Why llguidance would take c and not enforce it, or None (regex_flaw, schema_flaw)."""
    if c.kind == "regex":
        return regex_flaw(c.spec)
    return schema_flaw(json.loads(c.spec)) if c.kind == "json_schema" else None


def regex_flaw(regex: str) -> str | None:
    """Why a regular expression is refused before llguidance reads it, or None: one that ends
    in a lone backslash (an escape of nothing, which llguidance drops)."""
    if (len(regex) - len(regex.rstrip("\\"))) % 2:
        return "it ends in a lone backslash, which escapes nothing (a backslash is \\\\)"
    return None


def schema_flaw(schema) -> str | None:
    """Why no finite JSON value matches a schema, or None when one may: a $ref (local: "#...")
    that leads back to itself through what every value must hold (a required property, an
    array's first minItems items, each branch of anyOf or oneOf, any of allOf) never ends.
    Generous where unsure: only what certainly has no finite value is named."""
    refs = [r for r in local_refs(schema) if resolve(schema, r) is not None]
    users: dict[str, list[str]] = {r: [] for r in refs}    # the refs whose schema holds it
    for r in refs:
        for d in local_refs(resolve(schema, r)):
            users.get(d, []).append(r)
    finite: set[str] = set()                        # the refs known to have a finite value
    try:
        todo = list(refs)
        while todo:                                 # a ref is judged again when one it holds
            r = todo.pop()                          # is found finite
            if r not in finite and has_finite(resolve(schema, r), schema, finite):
                finite.add(r)
                todo += users[r]
        if has_finite(schema, schema, finite):
            return None
    except RecursionError:
        return None
    loop = next((r for r in refs if r not in finite), None)
    if loop is None:                                # not through a $ref: llguidance judges
        return None
    return f"no finite JSON value matches it: its $ref {loop!r} always leads back to itself " \
           f"(through required properties, an array's first items or every branch)"


DATA = ("const", "enum", "default", "examples")     # keywords whose values are data, not schemas


def patterns(schema) -> list[str]:
    """The `pattern`s a schema holds (each string's regular expression), in the order they
    come, once each; the values of DATA's keywords are not read."""
    found, todo = {}, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(p := node.get("pattern"), str):
                found.setdefault(p)
            todo += reversed([v for k, v in node.items() if k not in DATA])
        elif isinstance(node, list):
            todo += reversed(node)
    return list(found)


def local_refs(schema) -> list[str]:
    """The local $refs ("#...") a schema holds, in the order they come, once each."""
    found, todo = {}, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
                found.setdefault(ref)
            todo += reversed(list(node.values()))
        elif isinstance(node, list):
            todo += reversed(node)
    return list(found)


def resolve(root, ref: str):
    """The subschema a local $ref ("#", "#/$defs/name", any JSON pointer) names; None if none."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def has_finite(s, root, finite: set[str]) -> bool:
    """Whether a finite value may match s, the refs in `finite` known to have one."""
    if not isinstance(s, dict):
        return s is not False
    one = lambda x: has_finite(x, root, finite)
    ref = s.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite \
            and resolve(root, ref) is not None:
        return False
    if isinstance(s.get("allOf"), list) and not all(map(one, s["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and s[key] and not any(map(one, s[key])):
            return False
    if "const" in s or "enum" in s:
        return True
    types = s.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None or set(types) - {"object", "array"}:
        return True                                 # a scalar, or no type: one is finite
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    required = s.get("required") if isinstance(s.get("required"), list) else []
    if "object" in types and all(one(props.get(k, True)) for k in required if isinstance(k, str)):
        return True
    return "array" in types and all(one(item) for item in first_items(s))


def first_items(s: dict) -> list:
    """The schemas of an array's first minItems items (each of prefixItems, then items; the
    items after prefixItems once, as they are all one schema)."""
    least = s.get("minItems") if isinstance(s.get("minItems"), int) else 0
    items = s.get("items", True)
    prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else \
        items if isinstance(items, list) else []
    rest = s.get("additionalItems", True) if isinstance(items, list) else items
    return prefix[:least] + ([rest] if least > len(prefix) else [])
