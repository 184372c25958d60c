"""The questions of ``kvpush eval``: short, each with the answers that count as right
(facts, arithmetic, instruction following). Each was kept only after SmolLM2-135M-Instruct
(``kvpush models make --name smollm2-135m``) answered it right on one vLLM CPU engine
alone, greedy, in 24 tokens, so a wrong answer through P/D means the path changed the
answer, not that the model does not know it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """A question and the answers accepted (any of them, as a word, case-insensitive)."""

    text: str
    accepted: tuple[str, ...]


QUESTIONS: tuple[Question, ...] = (
    Question('What is the capital of France?', ('Paris',)),
    Question('What is the capital of Japan?', ('Tokyo',)),
    Question('What is the capital of Italy?', ('Rome',)),
    Question('What is the capital of Germany?', ('Berlin',)),
    Question('What is the capital of the United Kingdom?', ('London',)),
    Question('What is the capital of Russia?', ('Moscow',)),
    Question('What is the capital of China?', ('Beijing',)),
    Question('What is the capital of Egypt?', ('Cairo',)),
    Question('What is the capital of Canada?', ('Ottawa',)),
    Question('What is the capital of Australia?', ('Canberra',)),
    Question('What is the capital of Greece?', ('Athens',)),
    Question('What is the capital of Ireland?', ('Dublin',)),
    Question('What is the capital of Norway?', ('Oslo',)),
    Question('What is the capital of Sweden?', ('Stockholm',)),
    Question('What is the capital of Austria?', ('Vienna',)),
    Question('What is the capital of Poland?', ('Warsaw',)),
    Question('What is the capital of India?', ('New Delhi', 'Delhi')),
    Question('What is the capital of South Korea?', ('Seoul',)),
    Question('What is the capital of Thailand?', ('Bangkok',)),
    Question('What is the capital of Kenya?', ('Nairobi',)),
    Question('What is the capital of Netherlands?', ('Amsterdam',)),
    Question('What is the capital of Switzerland?', ('Bern',)),
    Question('How many days are in a week?', ('7', 'seven')),
    Question('How many seconds are in a minute?', ('60', 'sixty')),
    Question('How many legs does a spider have?', ('8', 'eight')),
    Question('How many legs does a dog have?', ('4', 'four')),
    Question('How many continents are there?', ('7', 'seven')),
    Question('How many sides does a triangle have?', ('3', 'three')),
    Question('How many sides does a square have?', ('4', 'four')),
    Question('How many sides does a hexagon have?', ('6', 'six')),
    Question('What is 2 + 2?', ('4', 'four')),
    Question('What is 9 times 9?', ('81',)),
    Question('What is 100 divided by 4?', ('25',)),
    Question('What planet is known as the Red Planet?', ('Mars',)),
    Question('What is the largest ocean on Earth?', ('Pacific',)),
    Question('What is the chemical symbol for water?', ('H2O', 'H₂O')),
    Question('What is the chemical symbol for gold?', ('Au',)),
    Question('What gas do plants absorb from the air?', ('carbon dioxide', 'CO2')),
    Question('What gas do humans need to breathe?', ('oxygen',)),
    Question('What is the boiling point of water in Celsius?', ('100',)),
    Question('Who wrote Romeo and Juliet?', ('Shakespeare',)),
    Question('Who developed the theory of relativity?', ('Einstein',)),
    Question('What is the tallest mountain in the world?', ('Everest',)),
    Question('What is the longest river in the world?', ('Nile', 'Amazon')),
    Question('What color is the sky on a clear day?', ('blue',)),
    Question('What is the opposite of hot?', ('cold',)),
    Question('What is the opposite of up?', ('down',)),
    Question('What is the opposite of day?', ('night',)),
    Question('What is the plural of mouse?', ('mice',)),
    Question('What is the plural of child?', ('children',)),
    Question('What language is spoken in Brazil?', ('Portuguese',)),
    Question('What language is spoken in France?', ('French',)),
    Question('What language is spoken in Germany?', ('German',)),
    Question('What currency is used in Japan?', ('yen',)),
    Question('What currency is used in the United States?', ('dollar',)),
    Question('What do cows drink?', ('water',)),
    Question('What is the largest desert in the world?', ('Sahara', 'Antarctic')),
    Question('Say hello in Spanish.', ('hola',)),
    Question('Complete the sentence: The early bird catches the ...', ('worm',)),
    Question('What year did World War II end?', ('1945',)),
)
