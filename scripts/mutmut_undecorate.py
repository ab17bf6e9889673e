"""Rewrite module-level decorated functions of the given files as plain definitions followed by the
decorator call, for the mutmut staging copy made by scripts/mutmut.sh (never run on the working tree).

mutmut 3 does not mutate decorated functions (mutmut/mutation/file_mutation.py: a decorator could run
twice when it copies the function), and the spec registers its rules and invariants with decorators
(``@rule(...)`` in spec/rules.py, ``@state_invariant(...)`` in spec/invariants.py). This rewrite

    @a(x)
    @b
    def f(...): ...

into

    def f(...): ...
    f = a(x)(b(f))

which binds the same object to ``f`` and registers it in the same order, so mutmut mutates the bodies.

Usage: python scripts/mutmut_undecorate.py FILE... (rewrites the files in place).
"""

from __future__ import annotations

import sys

import libcst as cst


class _Undecorate(cst.CSTTransformer):
    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body: list[cst.CSTNode] = []
        for statement in updated_node.body:
            if isinstance(statement, cst.FunctionDef) and statement.decorators:
                call: cst.BaseExpression = cst.Name(statement.name.value)
                for decorator in reversed(statement.decorators):
                    call = cst.Call(func=decorator.decorator, args=[cst.Arg(call)])
                body.append(statement.with_changes(decorators=[]))
                body.append(cst.SimpleStatementLine(
                    [cst.Assign(targets=[cst.AssignTarget(cst.Name(statement.name.value))], value=call)]))
            else:
                body.append(statement)
        return updated_node.with_changes(body=body)


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            module = cst.parse_module(f.read())
        with open(path, "w", encoding="utf-8") as f:
            f.write(module.visit(_Undecorate()).code)


if __name__ == "__main__":
    main(sys.argv[1:])
