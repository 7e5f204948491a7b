"""Benchmarks run from the checkout's root as ``python -m benchmarks.<name>`` (not part of the installed
package; shared shapes and timers in :mod:`benchmarks.common`)."""
