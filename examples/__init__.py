"""Examples of using the conformance suite from outside the project (not packaged).

- ``toy_engine``: an adapter with two real registry bugs, listed in its xfail file.
- ``engine_registry``: a correct registry written the way engines write theirs; it passes every
  core test and fails only strict ones (listed in its xfail file).
- ``plugin_inert``: an unrelated project's tests, run by ``nox -s plugin`` in a fresh virtualenv
  to show the installed pytest plugin changes nothing there.
"""
