"""The test suite's time by file, from a run's JUnit XML, and `tests/conftest.py`'s
`SLOWEST_FIRST` in that order.

    bash scripts/test.sh --junitxml=/tmp/tests.xml
    .venv/bin/python scripts/test_times.py /tmp/tests.xml

Each file's figure is the sum of its tests' times (setup, call and teardown) in
one of the two worker processes; the suite's wall time is about half their total
when the workers finish together, which the order (slowest first) is for.
"""

import argparse
import collections
import xml.etree.ElementTree as ET


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml")
    args = p.parse_args()
    seconds: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    for case in ET.parse(args.junit_xml).iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        seconds[name] += float(case.get("time", 0))
        tests[name] += 1
    total = sum(seconds.values())
    print(f"{total:.0f} s in {sum(tests.values())} tests, {len(tests)} files\n")
    for name, s in seconds.most_common():
        print(f"{s:7.1f} s {tests[name]:5d} tests  {name}")
    print("\nSLOWEST_FIRST = (")
    for name, s in seconds.most_common():
        print(f'    "{name}",  # {s:.0f} s')
    print(")")


if __name__ == "__main__":
    main()
