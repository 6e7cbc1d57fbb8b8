"""Credit methods of one's own: `--credit_module M` (a .py path or a dotted module name) lists methods in
CREDIT_METHODS, which join oar/credit.py's table for the run after the protocol is checked.

A module that does not import, lists no methods, breaks the protocol (oar.credit.CreditMethod's
fields and the arguments of prepare / weigh; oar/credit_protocol.py), clashes with a built-in name or lists a name
twice
stops the run before anything loads, with a CreditError that names it (docs/credit-methods.md).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path

from oar.credit_protocol import CreditError, CreditMethod, protocol_problem


@functools.cache
def module_methods(module: str, builtins: tuple[str, ...] = ()) -> tuple[CreditMethod, ...]:
    """The methods `module` (a dotted name or a .py path) lists in CREDIT_METHODS, checked, none named
    as one of `builtins` (oar.credit passes its table's names); cached, so every call of a run
    (check_config, train.py, step_credit) sees the same objects."""
    where = f"--credit_module {module}"
    try:
        if module.endswith(".py"):
            path = Path(module).resolve()
            if not path.is_file():
                raise CreditError(
                    f"{where}: no such file; pass a path to a .py file or a dotted module name on the Python path."
                )
            spec = importlib.util.spec_from_file_location(f"oar_credit_module_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses and pickling look their module up here
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[spec.name]
                raise
        else:
            mod = importlib.import_module(module)
    except CreditError:
        raise
    except Exception as err:  # the user's module: any error in it is the user's to fix, and named
        raise CreditError(
            f"{where}: could not import it ({type(err).__name__}: {err}); pass a path to a .py "
            f"file or a dotted module name on the Python path (PYTHONPATH)."
        ) from None
    listed = getattr(mod, "CREDIT_METHODS", None)
    if not isinstance(listed, (list, tuple)) or not listed:
        raise CreditError(
            f"{where}: defines no CREDIT_METHODS, a non-empty list of oar.credit.CreditMethod "
            "(docs/credit-methods.md)."
        )
    names = set()
    for k, m in enumerate(listed):
        problem = protocol_problem(m)
        if problem:
            raise CreditError(
                f"{where}: CREDIT_METHODS[{k}]: {problem} (the protocol: oar/credit.py, docs/credit-methods.md)."
            )
        if m.name in builtins:
            raise CreditError(
                f"{where}: method {m.name!r} clashes with the built-in method of that name; give it another name."
            )
        if m.name in names:
            raise CreditError(f"{where}: method {m.name!r} is listed twice in CREDIT_METHODS.")
        names.add(m.name)
    return tuple(listed)
