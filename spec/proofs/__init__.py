"""Z3 proofs of the spec's central theorem: its local rules suffice for its invariants, whatever the
policy (``Init => Inv`` and ``Inv and Allowed(plan) and Update => Inv'``). See ``docs/proofs.md``.

- :mod:`.core`: options, theorems and results (imports no z3);
- :mod:`.encoding`: state, config, allowed-plan rules and update as quantifier-free integer arithmetic;
- :mod:`.theorems`: the theorems; :mod:`.solve`: running a query; :mod:`.concrete`: Python values as
  numerals (how the encoding is tested against the code).

Only :mod:`.core` may be imported without z3; ``schedspec.spec`` itself never imports this package.
"""
