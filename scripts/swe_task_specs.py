"""The small Python repositories behind ``configs/recipes/swe/tasks.jsonl`` (read by ``make_swe_tasks.py``).

Each :class:`Spec` is one repository with one real bug: its source files (buggy), its existing
tests (they pass before and after the fix: PASS_TO_PASS), the hidden regression test that shows
the bug (it fails before the fix and passes after: FAIL_TO_PASS), the reference fix as exact text
replacements, and the problem statement a user would file. Standard library only; tests are
``unittest`` so ``python3 -m unittest`` runs them with nothing installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from textwrap import dedent


@dataclass(frozen=True)
class Spec:
    """One repository: ``files`` (buggy sources), ``tests`` (shipped tests), ``hidden_tests`` (the
    regression tests the grader adds), ``fix`` (``(path, old, new)`` replacements, each ``old``
    occurring exactly once), ``problem`` (the issue text) and ``bug`` (its kind)."""

    name: str
    bug: str
    problem: str
    files: dict[str, str]
    tests: dict[str, str]
    hidden_tests: dict[str, str]
    fix: list[tuple[str, str, str]] = field(default_factory=list)


def _d(text: str) -> str:
    return dedent(text).lstrip("\n")


def _test(module: str, imports: str, body: str, cls: str = "TestBasics") -> str:
    """A unittest module: ``from <module> import <imports>`` and one class with ``body`` (its methods)."""
    return (f"import unittest\n\nfrom {module} import {imports}\n\n\nclass {cls}(unittest.TestCase):\n"
            + "".join("    " + line if line.strip() else line for line in _d(body).splitlines(True))
            + "\n\nif __name__ == \"__main__\":\n    unittest.main()\n")


SPECS: list[Spec] = [
    Spec(
        name="pager", bug="off-by-one",
        problem="`paginate(items, page, per_page)` drops the last item of every page: with 10 items and "
                "per_page=3, page 1 returns only 2 items.",
        files={"pager/__init__.py": "", "pager/core.py": _d('''
            def paginate(items, page, per_page=10):
                """Items of the 1-based ``page`` when ``items`` are split into pages of ``per_page``."""
                if page < 1 or per_page < 1:
                    raise ValueError("page and per_page must be >= 1")
                start = (page - 1) * per_page
                return list(items[start:start + per_page - 1])


            def page_count(total, per_page=10):
                """Number of pages needed for ``total`` items."""
                return (total + per_page - 1) // per_page
            ''')},
        tests={"tests/__init__.py": "", "tests/test_core.py": _test("pager.core", "page_count, paginate", '''
            def test_page_count(self):
                self.assertEqual(page_count(10, 3), 4)
                self.assertEqual(page_count(0, 3), 0)

            def test_bad_page(self):
                with self.assertRaises(ValueError):
                    paginate([1, 2], 0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("pager.core", "paginate", '''
            def test_full_pages(self):
                items = list(range(10))
                self.assertEqual(paginate(items, 1, 3), [0, 1, 2])
                self.assertEqual(paginate(items, 4, 3), [9])
            ''', "TestIssue")},
        fix=[("pager/core.py", "start + per_page - 1]", "start + per_page]")]),
    Spec(
        name="temperature", bug="wrong operator",
        problem="`fahrenheit_to_celsius(212)` returns 891 instead of 100.0: the conversion subtracts 9 "
                "where it should divide by it.",
        files={"temperature/__init__.py": "", "temperature/convert.py": _d('''
            def celsius_to_fahrenheit(c):
                """Degrees Celsius to degrees Fahrenheit."""
                return c * 9 / 5 + 32


            def fahrenheit_to_celsius(f):
                """Degrees Fahrenheit to degrees Celsius."""
                return (f - 32) * 5 - 9
            ''')},
        tests={"tests/__init__.py": "",
               "tests/test_convert.py": _test("temperature.convert", "celsius_to_fahrenheit", '''
            def test_boiling(self):
                self.assertAlmostEqual(celsius_to_fahrenheit(100), 212.0)

            def test_freezing(self):
                self.assertAlmostEqual(celsius_to_fahrenheit(0), 32.0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("temperature.convert", "fahrenheit_to_celsius", '''
            def test_to_celsius(self):
                self.assertAlmostEqual(fahrenheit_to_celsius(212), 100.0)
                self.assertAlmostEqual(fahrenheit_to_celsius(-40), -40.0)
            ''', "TestIssue")},
        fix=[("temperature/convert.py", "return (f - 32) * 5 - 9", "return (f - 32) * 5 / 9")]),
    Spec(
        name="grades", bug="wrong comparison",
        problem="`letter_grade(90)` returns 'B' but a score of exactly 90 is an 'A' (the boundaries are "
                "inclusive: 90 and above is A, 80 and above is B, ...).",
        files={"grades/__init__.py": "", "grades/letters.py": _d('''
            BOUNDS = [(90, "A"), (80, "B"), (70, "C"), (60, "D")]


            def letter_grade(score):
                """The letter for a 0-100 score: A from 90, B from 80, C from 70, D from 60, else F."""
                for bound, letter in BOUNDS:
                    if score > bound:
                        return letter
                return "F"
            ''')},
        tests={"tests/__init__.py": "", "tests/test_letters.py": _test("grades.letters", "letter_grade", '''
            def test_middle_of_bands(self):
                self.assertEqual(letter_grade(95), "A")
                self.assertEqual(letter_grade(85), "B")
                self.assertEqual(letter_grade(42), "F")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("grades.letters", "letter_grade", '''
            def test_boundaries_inclusive(self):
                self.assertEqual(letter_grade(90), "A")
                self.assertEqual(letter_grade(60), "D")
            ''', "TestIssue")},
        fix=[("grades/letters.py", "if score > bound:", "if score >= bound:")]),
    Spec(
        name="wordcount", bug="missing case",
        problem="`count_words` counts 'Hello' and 'hello' as two different words; counting should be "
                "case-insensitive (keys lower-cased).",
        files={"wordcount/__init__.py": "", "wordcount/count.py": _d('''
            import re


            def count_words(text):
                """How often each word occurs in ``text`` (words are runs of letters, case-insensitive)."""
                counts = {}
                for word in re.findall(r"[A-Za-z]+", text):
                    counts[word] = counts.get(word, 0) + 1
                return counts
            ''')},
        tests={"tests/__init__.py": "", "tests/test_count.py": _test("wordcount.count", "count_words", '''
            def test_simple(self):
                self.assertEqual(count_words("a b a"), {"a": 2, "b": 1})

            def test_empty(self):
                self.assertEqual(count_words(""), {})
            ''')},
        hidden_tests={"tests/test_issue.py": _test("wordcount.count", "count_words", '''
            def test_case_insensitive(self):
                self.assertEqual(count_words("Hello hello HELLO"), {"hello": 3})
            ''', "TestIssue")},
        fix=[("wordcount/count.py", "counts[word] = counts.get(word, 0) + 1",
              "word = word.lower()\n        counts[word] = counts.get(word, 0) + 1")]),
    Spec(
        name="retry", bug="wrong default",
        problem="`Retry()` documents 3 attempts by default but only tries once: `Retry().attempts` is 1.",
        files={"retry/__init__.py": "", "retry/policy.py": _d('''
            class Retry:
                """Call a function until it succeeds, ``attempts`` times at most (3 by default)."""

                def __init__(self, attempts=1):
                    if attempts < 1:
                        raise ValueError("attempts must be >= 1")
                    self.attempts = attempts

                def call(self, fn):
                    error = None
                    for _ in range(self.attempts):
                        try:
                            return fn()
                        except Exception as exc:  # retried
                            error = exc
                    raise error
            ''')},
        tests={"tests/__init__.py": "", "tests/test_policy.py": _test("retry.policy", "Retry", '''
            def test_succeeds_first_time(self):
                self.assertEqual(Retry(2).call(lambda: 5), 5)

            def test_gives_up(self):
                def boom():
                    raise KeyError("x")
                with self.assertRaises(KeyError):
                    Retry(2).call(boom)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("retry.policy", "Retry", '''
            def test_default_three_attempts(self):
                calls = []

                def flaky():
                    calls.append(1)
                    if len(calls) < 3:
                        raise RuntimeError("not yet")
                    return "ok"
                self.assertEqual(Retry().attempts, 3)
                self.assertEqual(Retry().call(flaky), "ok")
            ''', "TestIssue")},
        fix=[("retry/policy.py", "def __init__(self, attempts=1):", "def __init__(self, attempts=3):")]),
    Spec(
        name="stack", bug="wrong index",
        problem="`Stack.peek()` returns the bottom element instead of the top one.",
        files={"stack/__init__.py": "", "stack/stack.py": _d('''
            class Stack:
                """A last-in first-out stack."""

                def __init__(self):
                    self._items = []

                def push(self, item):
                    self._items.append(item)

                def pop(self):
                    if not self._items:
                        raise IndexError("pop from an empty stack")
                    return self._items.pop()

                def peek(self):
                    """The top item, without removing it."""
                    if not self._items:
                        raise IndexError("peek at an empty stack")
                    return self._items[0]

                def __len__(self):
                    return len(self._items)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_stack.py": _test("stack.stack", "Stack", '''
            def test_push_pop(self):
                s = Stack()
                s.push(1)
                s.push(2)
                self.assertEqual(s.pop(), 2)
                self.assertEqual(len(s), 1)

            def test_empty_pop(self):
                with self.assertRaises(IndexError):
                    Stack().pop()
            ''')},
        hidden_tests={"tests/test_issue.py": _test("stack.stack", "Stack", '''
            def test_peek_top(self):
                s = Stack()
                s.push("a")
                s.push("b")
                self.assertEqual(s.peek(), "b")
                self.assertEqual(len(s), 2)
            ''', "TestIssue")},
        fix=[("stack/stack.py", "return self._items[0]", "return self._items[-1]")]),
    Spec(
        name="slugify", bug="missing case",
        problem="`slugify('  Hello   World ')` returns '-hello---world-'; runs of spaces should become one "
                "dash and leading/trailing spaces should be dropped ('hello-world').",
        files={"slugify/__init__.py": "", "slugify/slug.py": _d('''
            def slugify(title):
                """A URL slug: lower case, words joined by single dashes."""
                return title.lower().replace(" ", "-")
            ''')},
        tests={"tests/__init__.py": "", "tests/test_slug.py": _test("slugify.slug", "slugify", '''
            def test_simple(self):
                self.assertEqual(slugify("Hello World"), "hello-world")

            def test_one_word(self):
                self.assertEqual(slugify("Python"), "python")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("slugify.slug", "slugify", '''
            def test_extra_spaces(self):
                self.assertEqual(slugify("  Hello   World "), "hello-world")
            ''', "TestIssue")},
        fix=[("slugify/slug.py", 'return title.lower().replace(" ", "-")', 'return "-".join(title.lower().split())')]),
    Spec(
        name="clamp", bug="swapped arguments",
        problem="`clamp(15, 0, 10)` returns 0 instead of 10: values above the range come back as the lower "
                "bound.",
        files={"clamp/__init__.py": "", "clamp/numbers.py": _d('''
            def clamp(value, low, high):
                """``value`` limited to the closed range ``[low, high]``."""
                if low > high:
                    raise ValueError("low must be <= high")
                return max(low, min(value, low))
            ''')},
        tests={"tests/__init__.py": "", "tests/test_numbers.py": _test("clamp.numbers", "clamp", '''
            def test_below(self):
                self.assertEqual(clamp(-5, 0, 10), 0)

            def test_bad_range(self):
                with self.assertRaises(ValueError):
                    clamp(1, 5, 2)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("clamp.numbers", "clamp", '''
            def test_above_and_inside(self):
                self.assertEqual(clamp(15, 0, 10), 10)
                self.assertEqual(clamp(7, 0, 10), 7)
            ''', "TestIssue")},
        fix=[("clamp/numbers.py", "min(value, low)", "min(value, high)")]),
    Spec(
        name="fizzbuzz", bug="wrong order of cases",
        problem="`fizzbuzz(15)` returns 'Fizz' instead of 'FizzBuzz'.",
        files={"fizzbuzz/__init__.py": "", "fizzbuzz/game.py": _d('''
            def fizzbuzz(n):
                """'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else the number."""
                if n % 3 == 0:
                    return "Fizz"
                if n % 5 == 0:
                    return "Buzz"
                if n % 15 == 0:
                    return "FizzBuzz"
                return str(n)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_game.py": _test("fizzbuzz.game", "fizzbuzz", '''
            def test_fizz_buzz(self):
                self.assertEqual(fizzbuzz(9), "Fizz")
                self.assertEqual(fizzbuzz(10), "Buzz")
                self.assertEqual(fizzbuzz(7), "7")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("fizzbuzz.game", "fizzbuzz", '''
            def test_both(self):
                self.assertEqual(fizzbuzz(15), "FizzBuzz")
                self.assertEqual(fizzbuzz(45), "FizzBuzz")
            ''', "TestIssue")},
        fix=[("fizzbuzz/game.py", '    if n % 3 == 0:\n        return "Fizz"\n',
              '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"\n')]),
    Spec(
        name="average", bug="missing case",
        problem="`mean([])` raises ZeroDivisionError; it should raise ValueError('mean of an empty list').",
        files={"average/__init__.py": "", "average/stats.py": _d('''
            def mean(values):
                """Arithmetic mean of a non-empty list (ValueError for an empty one)."""
                return sum(values) / len(values)


            def median(values):
                """Middle value (mean of the two middle ones for an even count)."""
                ordered = sorted(values)
                mid = len(ordered) // 2
                if len(ordered) % 2:
                    return ordered[mid]
                return (ordered[mid - 1] + ordered[mid]) / 2
            ''')},
        tests={"tests/__init__.py": "", "tests/test_stats.py": _test("average.stats", "mean, median", '''
            def test_mean(self):
                self.assertEqual(mean([1, 2, 3]), 2)

            def test_median(self):
                self.assertEqual(median([3, 1, 2]), 2)
                self.assertEqual(median([4, 1, 2, 3]), 2.5)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("average.stats", "mean", '''
            def test_empty(self):
                with self.assertRaisesRegex(ValueError, "empty"):
                    mean([])
            ''', "TestIssue")},
        fix=[("average/stats.py", "    return sum(values) / len(values)",
              '    if not values:\n        raise ValueError("mean of an empty list")\n'
              '    return sum(values) / len(values)')]),
    Spec(
        name="inventory", bug="mutable default",
        problem="Two `Inventory()` objects share their items: adding to one shows up in the other.",
        files={"inventory/__init__.py": "", "inventory/store.py": _d('''
            class Inventory:
                """Item counts by name."""

                def __init__(self, items={}):
                    self.items = items

                def add(self, name, count=1):
                    self.items[name] = self.items.get(name, 0) + count

                def total(self):
                    return sum(self.items.values())
            ''')},
        tests={"tests/__init__.py": "", "tests/test_store.py": _test("inventory.store", "Inventory", '''
            def test_add(self):
                inv = Inventory({})
                inv.add("apple", 2)
                inv.add("apple")
                self.assertEqual(inv.items, {"apple": 3})
                self.assertEqual(inv.total(), 3)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("inventory.store", "Inventory", '''
            def test_independent(self):
                a, b = Inventory(), Inventory()
                a.add("pear")
                self.assertEqual(b.items, {})
            ''', "TestIssue")},
        fix=[("inventory/store.py", "def __init__(self, items={}):\n        self.items = items",
              "def __init__(self, items=None):\n        self.items = dict(items or {})")]),
    Spec(
        name="intervals", bug="wrong comparison",
        problem="`merge([(1, 3), (3, 5)])` keeps two intervals; intervals that touch should merge into (1, 5).",
        files={"intervals/__init__.py": "", "intervals/merge.py": _d('''
            def merge(intervals):
                """Merge overlapping or touching closed intervals ``(start, end)``; sorted output."""
                out = []
                for start, end in sorted(intervals):
                    if out and start < out[-1][1]:
                        out[-1] = (out[-1][0], max(out[-1][1], end))
                    else:
                        out.append((start, end))
                return out
            ''')},
        tests={"tests/__init__.py": "", "tests/test_merge.py": _test("intervals.merge", "merge", '''
            def test_overlap(self):
                self.assertEqual(merge([(1, 4), (2, 6), (8, 9)]), [(1, 6), (8, 9)])

            def test_empty(self):
                self.assertEqual(merge([]), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("intervals.merge", "merge", '''
            def test_touching(self):
                self.assertEqual(merge([(3, 5), (1, 3)]), [(1, 5)])
            ''', "TestIssue")},
        fix=[("intervals/merge.py", "start < out[-1][1]", "start <= out[-1][1]")]),
    Spec(
        name="binsearch", bug="off-by-one",
        problem="`find(items, x)` never finds the last element of the sorted list: `find([1, 2, 3], 3)` "
                "returns -1.",
        files={"binsearch/__init__.py": "", "binsearch/search.py": _d('''
            def find(items, target):
                """Index of ``target`` in the sorted list ``items``, or -1."""
                lo, hi = 0, len(items) - 2
                while lo <= hi:
                    mid = (lo + hi) // 2
                    if items[mid] == target:
                        return mid
                    if items[mid] < target:
                        lo = mid + 1
                    else:
                        hi = mid - 1
                return -1
            ''')},
        tests={"tests/__init__.py": "", "tests/test_search.py": _test("binsearch.search", "find", '''
            def test_found(self):
                self.assertEqual(find([1, 3, 5, 7, 9], 3), 1)

            def test_missing(self):
                self.assertEqual(find([1, 3, 5], 4), -1)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("binsearch.search", "find", '''
            def test_last(self):
                self.assertEqual(find([1, 2, 3], 3), 2)
                self.assertEqual(find([7], 7), 0)
            ''', "TestIssue")},
        fix=[("binsearch/search.py", "len(items) - 2", "len(items) - 1")]),
    Spec(
        name="leapyear", bug="missing case",
        problem="`is_leap(1900)` returns True, but century years are leap years only when divisible by 400.",
        files={"leapyear/__init__.py": "", "leapyear/calendar.py": _d('''
            def is_leap(year):
                """Whether ``year`` is a leap year in the Gregorian calendar."""
                return year % 4 == 0
            ''')},
        tests={"tests/__init__.py": "", "tests/test_calendar.py": _test("leapyear.calendar", "is_leap", '''
            def test_ordinary(self):
                self.assertTrue(is_leap(2024))
                self.assertFalse(is_leap(2023))

            def test_2000(self):
                self.assertTrue(is_leap(2000))
            ''')},
        hidden_tests={"tests/test_issue.py": _test("leapyear.calendar", "is_leap", '''
            def test_centuries(self):
                self.assertFalse(is_leap(1900))
                self.assertFalse(is_leap(2100))
            ''', "TestIssue")},
        fix=[("leapyear/calendar.py", "return year % 4 == 0",
              "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)")]),
    Spec(
        name="vowels", bug="missing case",
        problem="`count_vowels('AEIOU')` returns 0: upper-case vowels are not counted.",
        files={"vowels/__init__.py": "", "vowels/text.py": _d('''
            VOWELS = "aeiou"


            def count_vowels(text):
                """Number of vowels (a, e, i, o, u in either case) in ``text``."""
                return sum(1 for ch in text if ch in VOWELS)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_text.py": _test("vowels.text", "count_vowels", '''
            def test_lower(self):
                self.assertEqual(count_vowels("banana"), 3)

            def test_none(self):
                self.assertEqual(count_vowels("rhythm"), 0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("vowels.text", "count_vowels", '''
            def test_upper(self):
                self.assertEqual(count_vowels("AEIOU"), 5)
                self.assertEqual(count_vowels("Apple"), 2)
            ''', "TestIssue")},
        fix=[("vowels/text.py", "if ch in VOWELS)", "if ch.lower() in VOWELS)")]),
    Spec(
        name="discount", bug="wrong operator",
        problem="`apply_discount(200, 25)` returns 250.0; a 25% discount on 200 should give 150.0.",
        files={"discount/__init__.py": "", "discount/prices.py": _d('''
            def apply_discount(price, percent):
                """``price`` reduced by ``percent`` per cent (0-100)."""
                if not 0 <= percent <= 100:
                    raise ValueError("percent must be between 0 and 100")
                return price * (1 + percent / 100)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_prices.py": _test("discount.prices", "apply_discount", '''
            def test_zero(self):
                self.assertEqual(apply_discount(80, 0), 80)

            def test_range(self):
                with self.assertRaises(ValueError):
                    apply_discount(10, 120)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("discount.prices", "apply_discount", '''
            def test_quarter_off(self):
                self.assertAlmostEqual(apply_discount(200, 25), 150.0)
                self.assertAlmostEqual(apply_discount(50, 100), 0.0)
            ''', "TestIssue")},
        fix=[("discount/prices.py", "price * (1 + percent / 100)", "price * (1 - percent / 100)")]),
    Spec(
        name="chunks", bug="off-by-one",
        problem="`chunked([1, 2, 3, 4, 5], 2)` loses the trailing partial chunk [5].",
        files={"chunks/__init__.py": "", "chunks/split.py": _d('''
            def chunked(items, size):
                """``items`` in consecutive lists of ``size`` (the last one may be shorter)."""
                if size < 1:
                    raise ValueError("size must be >= 1")
                return [items[i:i + size] for i in range(0, len(items) - size + 1, size)]
            ''')},
        tests={"tests/__init__.py": "", "tests/test_split.py": _test("chunks.split", "chunked", '''
            def test_even(self):
                self.assertEqual(chunked([1, 2, 3, 4], 2), [[1, 2], [3, 4]])

            def test_bad_size(self):
                with self.assertRaises(ValueError):
                    chunked([1], 0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("chunks.split", "chunked", '''
            def test_partial_last(self):
                self.assertEqual(chunked([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])
                self.assertEqual(chunked([1], 3), [[1]])
            ''', "TestIssue")},
        fix=[("chunks/split.py", "range(0, len(items) - size + 1, size)", "range(0, len(items), size)")]),
    Spec(
        name="romans", bug="missing case",
        problem="`to_roman(4)` returns 'IIII' and `to_roman(9)` 'VIIII'; subtractive forms (IV, IX, XL, XC, "
                "CD, CM) are expected.",
        files={"romans/__init__.py": "", "romans/numerals.py": _d('''
            VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


            def to_roman(n):
                """``n`` (1-3999) in Roman numerals."""
                if not 0 < n < 4000:
                    raise ValueError("n must be in 1..3999")
                out = []
                for value, numeral in VALUES:
                    while n >= value:
                        out.append(numeral)
                        n -= value
                return "".join(out)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_numerals.py": _test("romans.numerals", "to_roman", '''
            def test_additive(self):
                self.assertEqual(to_roman(3), "III")
                self.assertEqual(to_roman(2023), "MMXXIII")

            def test_range(self):
                with self.assertRaises(ValueError):
                    to_roman(0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("romans.numerals", "to_roman", '''
            def test_subtractive(self):
                self.assertEqual(to_roman(4), "IV")
                self.assertEqual(to_roman(1994), "MCMXCIV")
            ''', "TestIssue")},
        fix=[("romans/numerals.py",
              'VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]',
              'VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),\n'
              '          (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]')]),
    Spec(
        name="palindrome", bug="missing case",
        problem="`is_palindrome('A man, a plan, a canal: Panama')` is False; punctuation, spaces and case "
                "should be ignored.",
        files={"palindrome/__init__.py": "", "palindrome/check.py": _d('''
            def is_palindrome(text):
                """Whether ``text`` reads the same backwards, ignoring case and anything but letters and digits."""
                return text == text[::-1]
            ''')},
        tests={"tests/__init__.py": "", "tests/test_check.py": _test("palindrome.check", "is_palindrome", '''
            def test_plain(self):
                self.assertTrue(is_palindrome("level"))
                self.assertFalse(is_palindrome("python"))
            ''')},
        hidden_tests={"tests/test_issue.py": _test("palindrome.check", "is_palindrome", '''
            def test_sentence(self):
                self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))
                self.assertTrue(is_palindrome("No 'x' in Nixon"))
            ''', "TestIssue")},
        fix=[("palindrome/check.py", "    return text == text[::-1]",
              "    text = [ch.lower() for ch in text if ch.isalnum()]\n    return text == text[::-1]")]),
    Spec(
        name="timeparse", bug="wrong constant",
        problem="`parse_duration('1h30m')` returns 3630 seconds instead of 5400: hours are counted as 60 "
                "seconds.",
        files={"timeparse/__init__.py": "", "timeparse/duration.py": _d('''
            import re

            UNITS = {"h": 60, "m": 60, "s": 1}


            def parse_duration(text):
                """Seconds in a duration like '1h30m', '45s' or '2h'."""
                parts = re.findall(r"(\\d+)([hms])", text)
                if not parts or "".join(n + u for n, u in parts) != text:
                    raise ValueError(f"bad duration {text!r}")
                return sum(int(n) * UNITS[u] for n, u in parts)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_duration.py": _test("timeparse.duration", "parse_duration", '''
            def test_minutes_seconds(self):
                self.assertEqual(parse_duration("2m5s"), 125)

            def test_bad(self):
                with self.assertRaises(ValueError):
                    parse_duration("soon")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("timeparse.duration", "parse_duration", '''
            def test_hours(self):
                self.assertEqual(parse_duration("1h30m"), 5400)
                self.assertEqual(parse_duration("2h"), 7200)
            ''', "TestIssue")},
        fix=[("timeparse/duration.py", 'UNITS = {"h": 60,', 'UNITS = {"h": 3600,')]),
    Spec(
        name="matrix", bug="wrong index",
        problem="`transpose([[1, 2, 3], [4, 5, 6]])` fails with IndexError; a 2x3 matrix should become 3x2.",
        files={"matrix/__init__.py": "", "matrix/ops.py": _d('''
            def transpose(rows):
                """The transpose of a rectangular matrix given as a list of rows."""
                if not rows:
                    return []
                return [[rows[j][i] for j in range(len(rows))] for i in range(len(rows))]
            ''')},
        tests={"tests/__init__.py": "", "tests/test_ops.py": _test("matrix.ops", "transpose", '''
            def test_square(self):
                self.assertEqual(transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])

            def test_empty(self):
                self.assertEqual(transpose([]), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("matrix.ops", "transpose", '''
            def test_rectangular(self):
                self.assertEqual(transpose([[1, 2, 3], [4, 5, 6]]), [[1, 4], [2, 5], [3, 6]])
            ''', "TestIssue")},
        fix=[("matrix/ops.py", "for i in range(len(rows))]", "for i in range(len(rows[0]))]")]),
    Spec(
        name="cart", bug="wrong default",
        problem="`Cart.total()` applies a 10% tax when no tax rate is given; the default rate should be 0.",
        files={"cart/__init__.py": "", "cart/cart.py": _d('''
            class Cart:
                """Line items (price, quantity) and their total."""

                def __init__(self):
                    self.lines = []

                def add(self, price, quantity=1):
                    self.lines.append((price, quantity))

                def total(self, tax_rate=0.1):
                    """Sum of price x quantity, plus ``tax_rate`` (a fraction, 0 by default)."""
                    subtotal = sum(p * q for p, q in self.lines)
                    return round(subtotal * (1 + tax_rate), 2)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_cart.py": _test("cart.cart", "Cart", '''
            def test_with_tax(self):
                c = Cart()
                c.add(10.0, 2)
                self.assertEqual(c.total(tax_rate=0.5), 30.0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("cart.cart", "Cart", '''
            def test_no_tax_by_default(self):
                c = Cart()
                c.add(2.5, 4)
                self.assertEqual(c.total(), 10.0)
            ''', "TestIssue")},
        fix=[("cart/cart.py", "def total(self, tax_rate=0.1):", "def total(self, tax_rate=0.0):")]),
    Spec(
        name="flatten", bug="missing case",
        problem="`flatten([1, [2, [3, [4]]]])` returns [1, 2, [3, [4]]]; nesting of any depth should be "
                "flattened.",
        files={"flatten/__init__.py": "", "flatten/lists.py": _d('''
            def flatten(items):
                """All non-list values of arbitrarily nested lists, in order."""
                out = []
                for item in items:
                    if isinstance(item, list):
                        out.extend(item)
                    else:
                        out.append(item)
                return out
            ''')},
        tests={"tests/__init__.py": "", "tests/test_lists.py": _test("flatten.lists", "flatten", '''
            def test_one_level(self):
                self.assertEqual(flatten([1, [2, 3], 4]), [1, 2, 3, 4])

            def test_flat(self):
                self.assertEqual(flatten([1, 2]), [1, 2])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("flatten.lists", "flatten", '''
            def test_deep(self):
                self.assertEqual(flatten([1, [2, [3, [4]]]]), [1, 2, 3, 4])
            ''', "TestIssue")},
        fix=[("flatten/lists.py", "out.extend(item)", "out.extend(flatten(item))")]),
    Spec(
        name="csvrow", bug="missing strip",
        problem="`parse_row('a, b ,c')` returns ['a', ' b ', 'c']; fields should have surrounding spaces "
                "removed.",
        files={"csvrow/__init__.py": "", "csvrow/parse.py": _d('''
            def parse_row(line, sep=","):
                """Fields of one separated line, surrounding whitespace removed."""
                if not line:
                    return []
                return [field for field in line.split(sep)]
            ''')},
        tests={"tests/__init__.py": "", "tests/test_parse.py": _test("csvrow.parse", "parse_row", '''
            def test_plain(self):
                self.assertEqual(parse_row("a,b,c"), ["a", "b", "c"])

            def test_empty(self):
                self.assertEqual(parse_row(""), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("csvrow.parse", "parse_row", '''
            def test_spaces(self):
                self.assertEqual(parse_row("a, b ,c"), ["a", "b", "c"])
                self.assertEqual(parse_row(" x ; y", sep=";"), ["x", "y"])
            ''', "TestIssue")},
        fix=[("csvrow/parse.py", "[field for field in line.split(sep)]",
              "[field.strip() for field in line.split(sep)]")]),
    Spec(
        name="counter", bug="wrong operator",
        problem="`RateCounter.rate()` returns events times seconds; it should be events per second.",
        files={"counter/__init__.py": "", "counter/rate.py": _d('''
            class RateCounter:
                """Counts events over a window of ``seconds``."""

                def __init__(self, seconds):
                    if seconds <= 0:
                        raise ValueError("seconds must be > 0")
                    self.seconds = seconds
                    self.events = 0

                def hit(self, n=1):
                    self.events += n

                def rate(self):
                    """Events per second over the window."""
                    return self.events * self.seconds
            ''')},
        tests={"tests/__init__.py": "", "tests/test_rate.py": _test("counter.rate", "RateCounter", '''
            def test_counts(self):
                c = RateCounter(10)
                c.hit()
                c.hit(4)
                self.assertEqual(c.events, 5)

            def test_bad_window(self):
                with self.assertRaises(ValueError):
                    RateCounter(0)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("counter.rate", "RateCounter", '''
            def test_rate(self):
                c = RateCounter(4)
                c.hit(10)
                self.assertEqual(c.rate(), 2.5)
            ''', "TestIssue")},
        fix=[("counter/rate.py", "return self.events * self.seconds", "return self.events / self.seconds")]),
    Spec(
        name="dedupe", bug="wrong data structure",
        problem="`dedupe([3, 1, 3, 2, 1])` returns the values sorted ([1, 2, 3]); it should keep the order of "
                "first occurrence ([3, 1, 2]).",
        files={"dedupe/__init__.py": "", "dedupe/unique.py": _d('''
            def dedupe(items):
                """``items`` without repeats, in the order each first appears."""
                return sorted(set(items))
            ''')},
        tests={"tests/__init__.py": "", "tests/test_unique.py": _test("dedupe.unique", "dedupe", '''
            def test_sorted_input(self):
                self.assertEqual(dedupe([1, 1, 2, 3, 3]), [1, 2, 3])

            def test_empty(self):
                self.assertEqual(dedupe([]), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("dedupe.unique", "dedupe", '''
            def test_keeps_order(self):
                self.assertEqual(dedupe([3, 1, 3, 2, 1]), [3, 1, 2])
            ''', "TestIssue")},
        fix=[("dedupe/unique.py", "return sorted(set(items))", "return list(dict.fromkeys(items))")]),
    Spec(
        name="bank", bug="missing check",
        problem="`Account.withdraw` lets the balance go negative; withdrawing more than the balance should "
                "raise ValueError and leave the balance unchanged.",
        files={"bank/__init__.py": "", "bank/account.py": _d('''
            class Account:
                """A balance with deposits and withdrawals (no overdraft)."""

                def __init__(self, balance=0):
                    self.balance = balance

                def deposit(self, amount):
                    if amount <= 0:
                        raise ValueError("amount must be positive")
                    self.balance += amount

                def withdraw(self, amount):
                    if amount <= 0:
                        raise ValueError("amount must be positive")
                    self.balance -= amount
            ''')},
        tests={"tests/__init__.py": "", "tests/test_account.py": _test("bank.account", "Account", '''
            def test_deposit_withdraw(self):
                a = Account(10)
                a.deposit(5)
                a.withdraw(12)
                self.assertEqual(a.balance, 3)

            def test_negative_deposit(self):
                with self.assertRaises(ValueError):
                    Account().deposit(-1)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("bank.account", "Account", '''
            def test_no_overdraft(self):
                a = Account(5)
                with self.assertRaises(ValueError):
                    a.withdraw(6)
                self.assertEqual(a.balance, 5)
            ''', "TestIssue")},
        fix=[("bank/account.py",
              "            raise ValueError(\"amount must be positive\")\n        self.balance -= amount",
              "            raise ValueError(\"amount must be positive\")\n        if amount > self.balance:\n"
              "            raise ValueError(\"insufficient funds\")\n        self.balance -= amount")]),
    Spec(
        name="caesar", bug="missing wrap-around",
        problem="`shift('xyz', 3)` returns '{|}' instead of 'abc': letters should wrap around the alphabet.",
        files={"caesar/__init__.py": "", "caesar/cipher.py": _d('''
            def shift(text, key):
                """Caesar cipher: shift lower-case letters by ``key``, wrapping around; other characters unchanged."""
                out = []
                for ch in text:
                    if "a" <= ch <= "z":
                        out.append(chr(ord(ch) + key))
                    else:
                        out.append(ch)
                return "".join(out)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_cipher.py": _test("caesar.cipher", "shift", '''
            def test_simple(self):
                self.assertEqual(shift("abc", 1), "bcd")

            def test_other_characters(self):
                self.assertEqual(shift("a b!", 2), "c d!")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("caesar.cipher", "shift", '''
            def test_wraps(self):
                self.assertEqual(shift("xyz", 3), "abc")
                self.assertEqual(shift("abc", -1), "zab")
            ''', "TestIssue")},
        fix=[("caesar/cipher.py", "out.append(chr(ord(ch) + key))",
              "out.append(chr((ord(ch) - ord(\"a\") + key) % 26 + ord(\"a\")))")]),
    Spec(
        name="version", bug="wrong comparison",
        problem="`newer('1.10.0', '1.9.0')` is False: versions are compared as strings instead of numbers.",
        files={"version/__init__.py": "", "version/compare.py": _d('''
            def parse(version):
                """'1.10.2' -> (1, 10, 2)."""
                return tuple(int(part) for part in version.split("."))


            def newer(a, b):
                """Whether version ``a`` is newer than version ``b``."""
                return a > b
            ''')},
        tests={"tests/__init__.py": "", "tests/test_compare.py": _test("version.compare", "newer, parse", '''
            def test_parse(self):
                self.assertEqual(parse("1.10.2"), (1, 10, 2))

            def test_simple(self):
                self.assertTrue(newer("2.0.0", "1.0.0"))
                self.assertFalse(newer("1.0.0", "1.0.0"))
            ''')},
        hidden_tests={"tests/test_issue.py": _test("version.compare", "newer", '''
            def test_numeric(self):
                self.assertTrue(newer("1.10.0", "1.9.0"))
                self.assertFalse(newer("1.9.9", "1.10.0"))
            ''', "TestIssue")},
        fix=[("version/compare.py", "    return a > b", "    return parse(a) > parse(b)")]),
    Spec(
        name="lru", bug="missing update",
        problem="`LRUCache.get` does not mark the key as recently used, so a key read just before an insert "
                "is evicted instead of the least recently used one.",
        files={"lru/__init__.py": "", "lru/cache.py": _d('''
            from collections import OrderedDict


            class LRUCache:
                """At most ``capacity`` entries; inserting beyond it evicts the least recently used."""

                def __init__(self, capacity):
                    self.capacity = capacity
                    self.data = OrderedDict()

                def get(self, key, default=None):
                    if key not in self.data:
                        return default
                    return self.data[key]

                def put(self, key, value):
                    self.data[key] = value
                    self.data.move_to_end(key)
                    if len(self.data) > self.capacity:
                        self.data.popitem(last=False)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_cache.py": _test("lru.cache", "LRUCache", '''
            def test_evicts_oldest(self):
                c = LRUCache(2)
                c.put("a", 1)
                c.put("b", 2)
                c.put("c", 3)
                self.assertIsNone(c.get("a"))
                self.assertEqual(c.get("c"), 3)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("lru.cache", "LRUCache", '''
            def test_get_refreshes(self):
                c = LRUCache(2)
                c.put("a", 1)
                c.put("b", 2)
                c.get("a")
                c.put("c", 3)
                self.assertEqual(c.get("a"), 1)
                self.assertIsNone(c.get("b"))
            ''', "TestIssue")},
        fix=[("lru/cache.py", "            return default\n        return self.data[key]",
              "            return default\n        self.data.move_to_end(key)\n        return self.data[key]")]),
    Spec(
        name="primes", bug="off-by-one",
        problem="`primes_up_to(13)` leaves out 13: the limit should be included.",
        files={"primes/__init__.py": "", "primes/sieve.py": _d('''
            def primes_up_to(n):
                """All primes <= ``n``, in increasing order."""
                if n < 2:
                    return []
                sieve = [True] * n
                sieve[0] = sieve[1] = False
                for i in range(2, int(n ** 0.5) + 1):
                    if sieve[i]:
                        for j in range(i * i, n, i):
                            sieve[j] = False
                return [i for i, is_prime in enumerate(sieve) if is_prime]
            ''')},
        tests={"tests/__init__.py": "", "tests/test_sieve.py": _test("primes.sieve", "primes_up_to", '''
            def test_small(self):
                self.assertEqual(primes_up_to(10), [2, 3, 5, 7])

            def test_none(self):
                self.assertEqual(primes_up_to(1), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("primes.sieve", "primes_up_to", '''
            def test_inclusive(self):
                self.assertEqual(primes_up_to(13), [2, 3, 5, 7, 11, 13])
                self.assertEqual(primes_up_to(2), [2])
            ''', "TestIssue")},
        fix=[("primes/sieve.py", "sieve = [True] * n\n", "sieve = [True] * (n + 1)\n"),
             ("primes/sieve.py", "range(i * i, n, i)", "range(i * i, n + 1, i)")]),
    Spec(
        name="textwrapper", bug="wrong comparison",
        problem="`wrap('aaa bbb ccc', 7)` puts each word on its own line although 'aaa bbb' (7 characters) "
                "fits the width.",
        files={"textwrapper/__init__.py": "", "textwrapper/wrap.py": _d('''
            def wrap(text, width):
                """Greedy word wrap: lines of at most ``width`` characters (a longer word gets its own line)."""
                lines, current = [], ""
                for word in text.split():
                    candidate = f"{current} {word}" if current else word
                    if len(candidate) < width:
                        current = candidate
                    else:
                        if current:
                            lines.append(current)
                        current = word
                if current:
                    lines.append(current)
                return lines
            ''')},
        tests={"tests/__init__.py": "", "tests/test_wrap.py": _test("textwrapper.wrap", "wrap", '''
            def test_wraps(self):
                self.assertEqual(wrap("aa bb cc", 6), ["aa bb", "cc"])

            def test_empty(self):
                self.assertEqual(wrap("", 5), [])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("textwrapper.wrap", "wrap", '''
            def test_exact_width(self):
                self.assertEqual(wrap("aaa bbb ccc", 7), ["aaa bbb", "ccc"])
            ''', "TestIssue")},
        fix=[("textwrapper/wrap.py", "if len(candidate) < width:", "if len(candidate) <= width:")]),
    Spec(
        name="config", bug="wrong type conversion",
        problem="`parse_bool('false')` returns True: any non-empty string is treated as true.",
        files={"config/__init__.py": "", "config/values.py": _d('''
            TRUE = {"1", "true", "yes", "on"}
            FALSE = {"0", "false", "no", "off"}


            def parse_bool(text):
                """'true'/'yes'/'on'/'1' -> True, 'false'/'no'/'off'/'0' -> False (any case); else ValueError."""
                value = text.strip().lower()
                if value not in TRUE | FALSE:
                    raise ValueError(f"not a boolean: {text!r}")
                return bool(value)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_values.py": _test("config.values", "parse_bool", '''
            def test_true(self):
                self.assertIs(parse_bool("Yes"), True)

            def test_invalid(self):
                with self.assertRaises(ValueError):
                    parse_bool("maybe")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("config.values", "parse_bool", '''
            def test_false(self):
                self.assertIs(parse_bool("false"), False)
                self.assertIs(parse_bool(" OFF "), False)
            ''', "TestIssue")},
        fix=[("config/values.py", "    return bool(value)", "    return value in TRUE")]),
    Spec(
        name="histogram", bug="off-by-one",
        problem="`bucket_counts([0, 5, 10], width=5, buckets=3)` raises IndexError for the value 10; "
                "the largest value belongs in the last bucket.",
        files={"histogram/__init__.py": "", "histogram/bins.py": _d('''
            def bucket_counts(values, width, buckets):
                """Counts of ``values`` in ``buckets`` bins of ``width`` starting at 0; values past the end
                go into the last bin."""
                counts = [0] * buckets
                for v in values:
                    index = min(int(v // width), buckets)
                    counts[index] += 1
                return counts
            ''')},
        tests={"tests/__init__.py": "", "tests/test_bins.py": _test("histogram.bins", "bucket_counts", '''
            def test_inside(self):
                self.assertEqual(bucket_counts([0, 1, 6], width=5, buckets=3), [2, 1, 0])
            ''')},
        hidden_tests={"tests/test_issue.py": _test("histogram.bins", "bucket_counts", '''
            def test_past_the_end(self):
                self.assertEqual(bucket_counts([0, 5, 10], width=5, buckets=3), [1, 1, 1])
                self.assertEqual(bucket_counts([99], width=5, buckets=3), [0, 0, 1])
            ''', "TestIssue")},
        fix=[("histogram/bins.py", "min(int(v // width), buckets)", "min(int(v // width), buckets - 1)")]),
    Spec(
        name="queue", bug="wrong end",
        problem="`Queue.dequeue()` returns the most recently added item; a queue is first-in first-out.",
        files={"queue_fifo/__init__.py": "", "queue_fifo/fifo.py": _d('''
            from collections import deque


            class Queue:
                """First-in first-out queue."""

                def __init__(self):
                    self._items = deque()

                def enqueue(self, item):
                    self._items.append(item)

                def dequeue(self):
                    if not self._items:
                        raise IndexError("dequeue from an empty queue")
                    return self._items.pop()

                def __len__(self):
                    return len(self._items)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_fifo.py": _test("queue_fifo.fifo", "Queue", '''
            def test_single(self):
                q = Queue()
                q.enqueue(1)
                self.assertEqual(q.dequeue(), 1)
                self.assertEqual(len(q), 0)

            def test_empty(self):
                with self.assertRaises(IndexError):
                    Queue().dequeue()
            ''')},
        hidden_tests={"tests/test_issue.py": _test("queue_fifo.fifo", "Queue", '''
            def test_fifo_order(self):
                q = Queue()
                for i in range(3):
                    q.enqueue(i)
                self.assertEqual([q.dequeue() for _ in range(3)], [0, 1, 2])
            ''', "TestIssue")},
        fix=[("queue_fifo/fifo.py", "return self._items.pop()", "return self._items.popleft()")]),
    Spec(
        name="gcdlib", bug="wrong return",
        problem="`lcm(4, 6)` returns 2 (the gcd) instead of 12.",
        files={"gcdlib/__init__.py": "", "gcdlib/arith.py": _d('''
            def gcd(a, b):
                """Greatest common divisor of two non-negative integers."""
                while b:
                    a, b = b, a % b
                return a


            def lcm(a, b):
                """Least common multiple of two positive integers."""
                return gcd(a, b)
            ''')},
        tests={"tests/__init__.py": "", "tests/test_arith.py": _test("gcdlib.arith", "gcd", '''
            def test_gcd(self):
                self.assertEqual(gcd(12, 18), 6)
                self.assertEqual(gcd(7, 0), 7)
            ''')},
        hidden_tests={"tests/test_issue.py": _test("gcdlib.arith", "lcm", '''
            def test_lcm(self):
                self.assertEqual(lcm(4, 6), 12)
                self.assertEqual(lcm(5, 7), 35)
            ''', "TestIssue")},
        fix=[("gcdlib/arith.py", "    return gcd(a, b)", "    return a * b // gcd(a, b)")]),
    Spec(
        name="initials", bug="missing case",
        problem="`initials('ada  lovelace')` raises IndexError when names are separated by more than one space.",
        files={"initials/__init__.py": "", "initials/names.py": _d('''
            def initials(name):
                """Upper-case initials of a name: 'ada lovelace' -> 'AL'."""
                return "".join(part[0].upper() for part in name.split(" "))
            ''')},
        tests={"tests/__init__.py": "", "tests/test_names.py": _test("initials.names", "initials", '''
            def test_two(self):
                self.assertEqual(initials("ada lovelace"), "AL")

            def test_one(self):
                self.assertEqual(initials("plato"), "P")
            ''')},
        hidden_tests={"tests/test_issue.py": _test("initials.names", "initials", '''
            def test_extra_spaces(self):
                self.assertEqual(initials("ada  lovelace "), "AL")
            ''', "TestIssue")},
        fix=[("initials/names.py", 'name.split(" ")', "name.split()")]),
]
