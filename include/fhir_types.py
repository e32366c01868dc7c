"""Which FHIR resource types, and which element paths in them, this build takes as R4.

Stageline validates FHIR with `fhir.resources`' R4B models (its 4.0.1 ones need pydantic v1, which
Airflow's pydantic 2 excludes). R4B keeps R4's JSON and most of its resources, not all: the ones
R4B added are not R4, and the R4 ones it dropped cannot be validated here. The FHIR inbound
(`listeners.fhir_inbound`) refuses both, and a route's ``fhir`` condition is checked against the
same models when the routes load, so a path that can never match (``Patient.foo``, ``Foo.bar``)
is a config error, not a silent route to nowhere. The models are imported on first use only.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Any

__all__ = ["R4B_ONLY", "R4_ONLY", "model_of", "path_problem", "why_not"]

# Resources only in R4 (4.0.1): R4B dropped or replaced them, so its models cannot validate them.
R4_ONLY = frozenset(
    {
        "EffectEvidenceSynthesis",
        "RiskEvidenceSynthesis",
        "MedicinalProduct",
        "MedicinalProductAuthorization",
        "MedicinalProductContraindication",
        "MedicinalProductIndication",
        "MedicinalProductIngredient",
        "MedicinalProductInteraction",
        "MedicinalProductManufactured",
        "MedicinalProductPackaged",
        "MedicinalProductPharmaceutical",
        "MedicinalProductUndesirableEffect",
        "SubstanceNucleicAcid",
        "SubstancePolymer",
        "SubstanceProtein",
        "SubstanceReferenceInformation",
        "SubstanceSourceMaterial",
        "SubstanceSpecification",
    }
)
# Resources R4B added: they are not R4.
R4B_ONLY = frozenset(
    {
        "AdministrableProductDefinition",
        "Citation",
        "ClinicalUseDefinition",
        "EvidenceReport",
        "Ingredient",
        "ManufacturedItemDefinition",
        "MedicinalProductDefinition",
        "NutritionProduct",
        "PackagedProductDefinition",
        "RegulatedAuthorization",
        "SubscriptionStatus",
        "SubscriptionTopic",
    }
)
_RESOURCE_TYPE = re.compile(r"[A-Z][A-Za-z]{1,63}")
_ABSTRACT = frozenset({"Resource", "DomainResource"})
_ANY_RESOURCE = object()  # an element that holds any resource (contained, Bundle.entry.resource)


def why_not(resource_type: str) -> str | None:
    """Why `resource_type` is not a resource type this build validates as R4, or None. The reason
    quotes the name only when it is well formed (a sender's made-up one is not echoed)."""
    if resource_type in R4_ONLY:
        return f"{resource_type} is an R4 resource this build cannot validate (its R4B models dropped it)"
    if resource_type in R4B_ONLY:
        return f"{resource_type} is R4B, not an R4 resource"
    try:
        if not _RESOURCE_TYPE.fullmatch(resource_type):
            raise KeyError(resource_type)
        model_of(resource_type)
    except (KeyError, ValueError):
        shown = "".join(c for c in resource_type[:40] if c.isalnum())
        return f"resourceType {shown!r} is not an R4 resource"
    return None


@functools.cache
def model_of(resource_type: str) -> Any:
    """The R4B model of a concrete resource type; KeyError for anything else — a data type
    (``HumanName``), an abstract base, or a name the package does not know. Call `why_not` first:
    only well-formed names get here (and into the cache)."""
    from fhir.resources.R4B import get_fhir_model_class
    from fhir.resources.R4B.resource import Resource

    model = get_fhir_model_class(resource_type)
    if resource_type in _ABSTRACT or not issubclass(model, Resource):
        raise KeyError(resource_type)
    return model


def path_problem(resource_type: str, elements: tuple[str, ...]) -> str | None:
    """Why ``resource_type.elements…`` can never name a value in R4, or None. Below an element that
    holds any resource (``contained``) nothing is checked; a primitive has nothing below it but
    its ``_element`` twin's ``id`` and ``extension``."""
    why = why_not(resource_type)
    if why is not None:
        return why
    model: Any = model_of(resource_type)
    for i, name in enumerate(elements):
        fields = _elements(model)
        if name not in fields:
            place = ".".join((resource_type, *elements[:i]))
            return f"{place} has no element {name!r} (R4B model {model.__name__})"
        below = _element_model(fields[name])
        if below is _ANY_RESOURCE:
            return None
        if below is None and i + 1 < len(elements):
            place = ".".join((resource_type, *elements[: i + 1]))
            return f"{place} is a primitive value: nothing is below it"
        model = below
    return None


@functools.cache
def _elements(model: Any) -> dict[str, Any]:
    """A model's elements by their JSON names (``_birthDate`` included), each its annotation."""
    return {(f.alias or k): f.annotation for k, f in model.model_fields.items() if k != "fhir_comments"}


def _element_model(annotation: Any) -> Any:
    """The model an element's values are (a complex type or backbone element), `_ANY_RESOURCE`,
    or None for a primitive."""
    from fhir.resources.R4B import get_fhir_model_class

    name = getattr(annotation, "__name__", "")
    if isinstance(annotation, type) and name.endswith("Type") and name != "Type":
        if name == "ResourceType":
            return _ANY_RESOURCE
        try:
            return get_fhir_model_class(name[: -len("Type")])
        except (KeyError, ValueError):
            return None
    for arg in typing.get_args(annotation):
        found = _element_model(arg)
        if found is not None:
            return found
    return None
