"""Texts the evaluation prompts (specdec/eval_prompts.py) are about, written for this project: short passages to
summarise, edit or quote from, a function and an email to edit, records to turn into JSON, and the documents a RAG
prompt answers from (together 1-2k tokens of context, as a retriever's top passages would be)."""

from __future__ import annotations

LIGHTHOUSE = (
    "The lighthouse on Skerry Point was built in 1872 after three ships were lost on the reef in a single "
    "winter. Its first keeper, Margaret Dunn, kept the lamp burning for thirty-one years, trimming the wick "
    "every four hours and writing the weather into a leather logbook that still survives. In 1931 the oil "
    "lamp was replaced by an electric light, and in 1987 the station was automated, so no keeper has lived "
    "there since. Today the cottage is a small museum, and the logbook is displayed in a glass case beside "
    "the original brass lens."
)

BATTERIES = (
    "Lithium-ion batteries age in two ways. Calendar ageing happens even when a battery sits unused: a thin "
    "layer called the solid electrolyte interphase slowly grows on the anode and consumes lithium, and it "
    "grows faster when the battery is stored hot or fully charged. Cycle ageing comes from use: every charge "
    "and discharge makes the electrode materials swell and shrink, which cracks particles and loosens their "
    "contact with the current collector. Manufacturers therefore recommend storing devices half charged in "
    "a cool place, and avoiding fast charging when the battery is already warm."
)

MEETING = (
    "Minutes of the garden committee, 4 March. Present: Ana, Bilal, Chen and Dora. The committee agreed to "
    "replace the broken water tank before the end of April; Bilal will collect three quotes. The spring plant "
    "sale will be held on 12 May, with Dora coordinating volunteers and Chen designing the poster. Ana "
    "reported that membership fees cover only two thirds of this year's costs, so the committee will apply "
    "for a small grant from the city council. The next meeting is on 1 April."
)

SLEEP = (
    "Researchers followed 2,000 adults for six years and recorded how long they slept each night. Those who "
    "regularly slept fewer than six hours were more likely to develop high blood pressure than those who slept "
    "seven to eight hours, even after accounting for age, weight and exercise. Sleeping more than nine hours "
    "was not protective either. The authors caution that the study shows an association rather than cause "
    "and effect, and they call for trials that extend sleep in short sleepers to test whether blood pressure "
    "falls."
)

BRIDGE = (
    "The Alder Street footbridge will close for repairs from 3 June to 28 July. Inspectors found rust on two of "
    "the steel cables and cracks in the concrete deck near the east ramp. During the closure, pedestrians "
    "should use the Mill Road crossing, about 400 metres downstream, and cyclists can take the riverside path, "
    "which will be lit at night. The repairs cost 1.2 million euros and are paid from the city's maintenance "
    "fund. A second inspection in September will decide whether the west ramp also needs work."
)

LIBRARY = (
    "From 1 September the central library opens from 9 am to 8 pm on weekdays and from 10 am to 4 pm on "
    "Saturdays; it stays closed on Sundays. Members may borrow up to twelve items at a time, for three weeks, "
    "and renew each item twice online. Late returns cost 20 cents per item per day, up to a maximum of 5 "
    "euros. Children's books carry no late fees. The study rooms on the second floor can be booked for two "
    "hours a day at the front desk or through the library's website."
)

RELEASE = (
    "Version 4.2 of the Tally accounting app adds bank imports in the CSV format used by most European banks, "
    "a dark theme, and a yearly report that groups expenses by category. It fixes a bug that rounded some "
    "currency amounts to the wrong cent and another that lost unsaved notes when the app was closed. Support "
    "for the old 3.x file format ends with this release: files saved by version 3 must be opened once in "
    "version 4.1 or 4.2 to convert them. The app now needs at least 2 GB of memory."
)

VOLCANO = (
    "Mount Tarel, a volcano on the island of Vessa, last erupted in 1911, when ash fell on villages forty "
    "kilometres away. Since 2019 the island's observatory has recorded small earthquakes under the summit, "
    "about thirty a month, and the ground on the western flank has risen by six centimetres. Scientists say "
    "an eruption is not expected soon, but the alert level was raised from green to yellow in March, which "
    "means hikers must register before climbing above 1,500 metres and the summit trail closes at 3 pm."
)

BAKERY = (
    "The Corner Loaf bakery was opened in 1998 by the brothers Tomas and Luis Ferrer. They bake about six "
    "hundred loaves a day in a wood-fired oven, starting at 3 am. Their best seller is a rye sourdough made "
    "with a starter that Luis brought from his grandmother's village. In 2021 the bakery began delivering by "
    "cargo bike to shops within five kilometres, and it now employs eleven people. On Sundays it sells only "
    "croissants and cinnamon rolls, and it closes for the whole of August."
)

HEATPUMP = (
    "A heat pump moves heat instead of making it. In winter an air-source heat pump pulls heat from the "
    "outside air, even at minus ten degrees, and pumps it into the house; in summer it can run in reverse and "
    "cool the rooms. For every unit of electricity it uses, a typical model delivers three to four units of "
    "heat, so it costs less to run than an electric heater. It works best in well insulated houses with large "
    "radiators or underfloor heating, because it heats water to a lower temperature than a gas boiler does."
)

TRAIN = (
    "Trains on the coast line run every thirty minutes between 6 am and 10 pm and every hour after that until "
    "midnight. From 14 October, the 7.12 and 7.42 departures from Harbour Station will also stop at Fenwick, "
    "adding four minutes to the journey. Bicycles are allowed on all trains except those arriving in the city "
    "between 7.30 and 9 am. A single ticket costs 3.40 euros and a day ticket 8 euros; children under twelve "
    "travel free with an adult."
)

DOCUMENTS = [("Skerry Point lighthouse", LIGHTHOUSE), ("Battery ageing", BATTERIES),
             ("Garden committee minutes", MEETING), ("Sleep study", SLEEP), ("Alder Street footbridge", BRIDGE),
             ("Library opening hours", LIBRARY), ("Tally 4.2 release notes", RELEASE), ("Mount Tarel", VOLCANO),
             ("The Corner Loaf", BAKERY), ("Heat pumps", HEATPUMP), ("Coast line timetable", TRAIN)]


def retrieved_context(order: list[int]) -> str:
    """The documents in `order`, numbered as a retriever hands them to a model."""
    return "\n\n".join(f"[{i + 1}] {DOCUMENTS[j][0]}\n{DOCUMENTS[j][1]}" for i, j in enumerate(order))


FUNCTION_INVOICE = '''def invoice_total(items, tax_rate, discount=0.0):
    """Return the total of an invoice: the sum of the items, less the discount, plus tax."""
    total = 0.0
    for item in items:
        if item["quantity"] <= 0:
            raise ValueError(f"bad quantity for {item['name']}")
        total += item["price"] * item["quantity"]
    total -= total * discount
    total += total * tax_rate
    return round(total, 2)
'''

FUNCTION_WORDS = '''def count_words(path):
    """Count how often each word occurs in a text file."""
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts
'''

EMAIL = (
    "Hi Sarah,\n\nThank you for sending the report so quickly. I have read it twice and I think the conclusions "
    "are clear, but the tabel on page four uses the wrong units for the water use figures. Could you change "
    "them to litres per day and send me the new version by Friday? I will forward it to the comittee on "
    "Monday morning.\n\nBest regards,\nDaniel"
)

CONTACT_NOTE = (
    "New customer: Priya Raman, 34, lives in Leeds and works as a civil engineer. She can be reached at "
    "priya.raman@example.com or on 0113 496 0721. She signed up on 2 February for the annual plan and "
    "prefers to be contacted by email."
)

BOOK_NOTE = (
    "Catalogue note: 'The Salt Road' by Helen Okafor, published by Marlow Press in 2016, 312 pages, "
    "paperback, ISBN 978-1-4028-9462-6. Shelved under travel and history; it has been borrowed 47 times."
)
