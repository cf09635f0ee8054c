"""What the tests share and is not a test: tiny models, fake servers, window drivers, the
child-process runner for native code, reference computations. Test modules import from here and
never from one another (tests/project/test_layout.py checks it).

Nothing is imported here: conftest.py imports tests.support.isolation before anything computes a
path, and a package import must not run ahead of it.
"""
