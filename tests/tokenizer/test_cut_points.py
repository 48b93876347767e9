"""A chat's cut points: the prompt positions where its messages end, as its template renders them."""

from __future__ import annotations

from strata.serve.cut_points import MAX_CUTS, message_cut_points

CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def _ids(tok, messages, generation: bool) -> list[int]:
    return tok.encode(_text(tok, messages, generation), add_special_tokens=False)


def _text(tok, messages, generation: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation)


def cuts_of(tok, messages) -> list[int]:
    return message_cut_points(tok, messages, {}, None, _text(tok, messages, True), _ids(tok, messages, True))


def test_every_message_end_is_a_cut_and_the_prompt_really_has_it(smol) -> None:
    prompt = _ids(smol, CHAT, True)
    cuts = cuts_of(smol, CHAT)
    want = [len(_ids(smol, CHAT[:k], False)) for k in range(1, len(CHAT))]
    assert cuts == want and len(set(cuts)) == 3 and 0 < cuts[0] and cuts[-1] < len(prompt)
    for k, cut in zip(range(1, len(CHAT)), cuts):
        assert prompt[:cut] == _ids(smol, CHAT[:k], False)  # the prefix the later requests share


def test_an_edit_shares_the_cuts_before_it(smol) -> None:
    edited = CHAT[:3] + [{"role": "user", "content": "And of Spain?"}]
    a = cuts_of(smol, CHAT)
    b = cuts_of(smol, edited)
    assert a == b  # the edited message starts at the same cut: a checkpoint there serves both


def test_a_prompt_the_template_did_not_render_has_no_cuts(smol) -> None:
    text = "plain text, no chat template at all"
    assert message_cut_points(smol, CHAT, {}, None, text, smol.encode(text, add_special_tokens=False)) == []


def test_a_long_chat_keeps_the_root_and_the_last_ends(smol) -> None:
    chat = [CHAT[0]] + [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                        for i in range(40)]
    cuts = cuts_of(smol, chat)
    assert len(cuts) == MAX_CUTS and cuts[0] == len(_ids(smol, chat[:1], False))
    assert cuts[-1] == len(_ids(smol, chat[:-1], False))
