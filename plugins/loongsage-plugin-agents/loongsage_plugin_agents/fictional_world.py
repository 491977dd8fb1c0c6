"""A made-up world of people, companies, cities and countries: a document corpus and questions
about it that need one or two look-ups.

Every name is invented from syllables, so no pretrained model knows an answer beforehand: the
only way to answer is to find the facts in the corpus. A world is a pure function of its
:class:`WorldSpec` (seeded; the same spec gives the same documents and questions, in the same
order).

The world has two **splits** with disjoint entities: ``"train"`` and ``"heldout"``. All names of
both are drawn first, unique across the two, then each split gets its own people, companies,
cities and countries, linked only among themselves, and its own corpus. A question of the held-out
split is about entities that no training question, and no training document, ever names.

Documents (title: text; the title is the entity's name)::

    Dovan Telmir: A baker, born in Moraheim, lives in Kesport, founder of Zorvak Motors.
    Zorvak Motors: A company based in Kesport, founded in 1873.
    Moraheim: A city in Velonia.
    Velonia: A country whose capital is Moraheim.

Questions (:data:`QUESTION_KINDS`): one hop (the fact is in the document of the entity the
question names: ``In which city was Dovan Telmir born?``) and two hops (the first document names
a second entity whose document holds the answer: ``In which year was the company of Dovan Telmir
founded?`` -> Zorvak Motors -> 1873). Each person has a first name shared with other people, so
a search for a person also finds namesakes.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs

SPLITS = ("train", "heldout")

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("", "n", "r", "l", "s", "k", "m")
COMPANY_SUFFIXES = ("Labs", "Works", "Motors", "Foods", "Media", "Textiles")
CITY_SUFFIXES = ("ton", "burg", "ford", "vale", "port", "heim")
COUNTRY_SUFFIXES = ("ia", "or", "ene", "land")
PROFESSIONS = ("baker", "painter", "sailor", "teacher", "farmer", "engineer", "weaver", "doctor")
YEARS = (1650, 1990)

QUESTION_KINDS: dict[str, tuple[int, str]] = {
    # kind: (hops, template); {name} is the entity the question starts from
    "born_city": (1, "In which city was {name} born?"),
    "home_city": (1, "In which city does {name} live?"),
    "founded_company": (1, "Which company did {name} found?"),
    "company_year": (1, "In which year was {name} founded?"),
    "company_city": (1, "In which city is {name} based?"),
    "city_country": (1, "In which country is {name}?"),
    "founded_year": (2, "In which year was the company of {name} founded?"),
    "founded_city": (2, "In which city is the company of {name} based?"),
    "born_country": (2, "In which country was {name} born?"),
    "home_country": (2, "In which country does {name} live?"),
}
"""Every kind of question: its number of hops and its wording."""


class WorldError(ValueError):
    """A world spec that cannot be built (the message names the argument)."""


@attrs.define(frozen=True)
class WorldSpec:
    """What a world is built from. Sizes are per split: ``people`` people (each founded one
    company), ``cities`` cities and ``countries`` countries in the training split, and
    ``heldout_*`` in the held-out one. First names are shared among each split's
    people (namesakes): about ``namesakes`` people share each first name."""

    seed: int = 0
    people: int = 240
    cities: int = 60
    countries: int = 8
    heldout_people: int = 60
    heldout_cities: int = 20
    heldout_countries: int = 4
    namesakes: int = 6

    def sizes(self, split: str) -> tuple[int, int, int]:
        """``(people, cities, countries)`` of ``split``."""
        check_split(split)
        if split == "train":
            return self.people, self.cities, self.countries
        return self.heldout_people, self.heldout_cities, self.heldout_countries

    def check(self) -> None:
        for name in ("people", "cities", "countries", "heldout_people", "heldout_cities", "heldout_countries",
                     "namesakes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorldError(f"fictional world: '{name}' must be an integer >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise WorldError(f"fictional world: 'seed' must be an integer, got {self.seed!r}")
        for split in SPLITS:
            people, cities, countries = self.sizes(split)
            if countries > cities:
                raise WorldError(f"fictional world: the {split} split has more countries ({countries}) than "
                                 f"cities ({cities}); every country needs a capital")

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


@attrs.define(frozen=True)
class Document:
    """One page of the corpus: its title (an entity's name), its text, and the facts the text
    states as ``(attribute, value)`` pairs in the order they appear."""

    title: str
    text: str
    facts: tuple[tuple[str, str], ...] = ()


@attrs.define(frozen=True)
class Question:
    """A question, its answer, its kind and hops, and the titles of the documents that answer it
    (in the order they must be read)."""

    question: str
    answer: str
    kind: str
    hops: int
    path: tuple[str, ...]


@attrs.define(frozen=True)
class World:
    """One split of a world: its corpus and every question about it."""

    documents: tuple[Document, ...]
    questions: tuple[Question, ...]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise WorldError(f"fictional world: unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def _word(rng: random.Random, syllables: int) -> str:
    text = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
    return text.capitalize()


def _unique(rng: random.Random, count: int, make: Any, taken: set[str]) -> list[str]:
    """``count`` new names from ``make(rng)``, none in ``taken`` and no word of one already used
    (so a search for one name never matches another entity's name by a shared word)."""
    out: list[str] = []
    for _ in range(count * 200):
        if len(out) == count:
            return out
        name = make(rng)
        words = {w.lower() for w in name.split()}
        if name in taken or words & taken:
            continue
        taken.add(name)
        taken.update(words - {s.lower() for s in COMPANY_SUFFIXES})
        out.append(name)
    raise WorldError(f"fictional world: could not draw {count} distinct names; ask for fewer entities")


@attrs.define
class _Entities:
    """The names of one split, drawn once for both splits."""

    first: list[str]
    last: list[str]
    companies: list[str]
    cities: list[str]
    countries: list[str]


def _draw_names(spec: WorldSpec) -> dict[str, _Entities]:
    rng = random.Random(f"fictional-world-{spec.seed}")
    taken: set[str] = set()
    out = {}
    for split in SPLITS:
        people, cities, countries = spec.sizes(split)
        out[split] = _Entities(
            first=_unique(rng, -(-people // spec.namesakes), lambda r: _word(r, 2), taken),
            last=_unique(rng, people, lambda r: _word(r, r.choice((2, 3))), taken),
            companies=_unique(rng, people, lambda r: f"{_word(r, 2)} {r.choice(COMPANY_SUFFIXES)}", taken),
            cities=_unique(rng, cities, lambda r: _word(r, 2) + r.choice(CITY_SUFFIXES), taken),
            countries=_unique(rng, countries, lambda r: _word(r, 2).rstrip("aeiouk") + r.choice(COUNTRY_SUFFIXES),
                              taken),
        )
    return out


def _build_split(spec: WorldSpec, names: _Entities, split: str) -> World:
    rng = random.Random(f"fictional-world-{spec.seed}-{split}")
    cities, countries = names.cities, names.countries
    # every country has a capital; every city is in a country
    country_of = {city: countries[i % len(countries)] for i, city in enumerate(cities)}
    capital = {country: cities[i] for i, country in enumerate(countries)}
    docs: list[Document] = []
    questions: list[Question] = []

    def ask(kind: str, name: str, answer: str, path: tuple[str, ...]) -> None:
        hops, template = QUESTION_KINDS[kind]
        assert hops == len(path)
        questions.append(Question(template.format(name=name), answer, kind, hops, path))

    for i, (last, company) in enumerate(zip(names.last, names.companies)):
        person = f"{names.first[i % len(names.first)]} {last}"
        born, home = rng.sample(cities, 2) if len(cities) > 1 else (cities[0], cities[0])
        # a company is never in its founder's cities: a two-hop answer is never in the first document
        based = rng.choice([c for c in cities if c not in (born, home)] or cities)
        year = str(rng.randint(*YEARS))
        job = rng.choice(PROFESSIONS)
        docs.append(Document(person, f"{'An' if job[0] in 'aeiou' else 'A'} {job}, born in {born}, lives in {home}, "
                                     f"founder of {company}.",
                             (("profession", job), ("born", born), ("home", home), ("company", company))))
        docs.append(Document(company, f"A company based in {based}, founded in {year}.",
                             (("based", based), ("year", year))))
        ask("born_city", person, born, (person,))
        ask("home_city", person, home, (person,))
        ask("founded_company", person, company, (person,))
        ask("company_year", company, year, (company,))
        ask("company_city", company, based, (company,))
        ask("founded_year", person, year, (person, company))
        ask("founded_city", person, based, (person, company))
        ask("born_country", person, country_of[born], (person, born))
        ask("home_country", person, country_of[home], (person, home))
    for city in cities:
        docs.append(Document(city, f"A city in {country_of[city]}.", (("country", country_of[city]),)))
        ask("city_country", city, country_of[city], (city,))
    for country in countries:
        docs.append(Document(country, f"A country whose capital is {capital[country]}.",
                             (("capital", capital[country]),)))
    return World(documents=tuple(docs), questions=tuple(questions))


@functools.lru_cache(maxsize=16)
def build_world(spec: WorldSpec, split: str) -> World:
    """The ``split`` of the world ``spec`` describes (cached: worlds are immutable)."""
    spec.check()
    check_split(split)
    return _build_split(spec, _draw_names(spec)[split], split)


def spec_from(args: dict[str, Any] | None) -> WorldSpec:
    """A :class:`WorldSpec` from a mapping of its fields (unknown keys are an error naming them)."""
    args = dict(args or {})
    known = {f.name for f in attrs.fields(WorldSpec)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise WorldError(f"fictional world: unknown argument(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    spec = WorldSpec(**args)
    spec.check()
    return spec
