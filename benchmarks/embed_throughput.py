"""Embedding throughput of pagedllm against sentence-transformers on the bundled all-MiniLM-L6-v2, same run.

Workload: --num-sentences deterministic sentences (seeded) of mixed length, from a few words to about 200 tokens,
in English, German, French, Spanish, Russian, Chinese and Japanese. Both engines embed the same texts in float32
with the same number of sentences per forward (--batch-size: sentence-transformers' batch_size, pagedllm's
max_num_seqs) and the same torch thread count; both times include tokenization. The engines run alternately
--repeats times and each keeps its best time (the machine is shared, so the best run is the least disturbed one).
One JSON line goes to stdout and to benchmarks/results.jsonl (unless --no-append).

    python benchmarks/embed_throughput.py
    python benchmarks/embed_throughput.py --num-sentences 200 --repeats 1 --no-append
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded, usable_cores
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded, usable_cores

WORDS = {
    "en": "the a model river city light small quickly under between people water house garden morning learn "
    "write travel music science history remember always never because although however window mountain "
    "computer language question answer market energy forest winter summer children teacher bridge".split(),
    "de": "der die das Haus Fluss Stadt Licht schnell zwischen Menschen Wasser Garten Morgen lernen schreiben "
    "reisen Musik Wissenschaft Geschichte immer niemals weil obwohl Fenster Berg Sprache Frage Antwort".split(),
    "fr": "le la les maison rivière ville lumière rapidement entre gens eau jardin matin apprendre écrire "
    "voyager musique science histoire toujours jamais parce que fenêtre montagne langue question réponse".split(),
    "es": "el la los casa río ciudad luz rápidamente entre gente agua jardín mañana aprender escribir viajar "
    "música ciencia historia siempre nunca porque aunque ventana montaña idioma pregunta respuesta".split(),
    "ru": "дом река город свет быстро между люди вода сад утро учиться писать путешествовать музыка наука "
    "история всегда никогда потому окно гора язык вопрос ответ рынок энергия лес зима лето".split(),
    "zh": "我们 城市 河流 光线 快速 之间 人们 水 花园 早上 学习 写作 旅行 音乐 科学 历史 总是 从不 因为 "
    "窗户 山 语言 问题 答案 市场 能源 森林 冬天 夏天".split(),
    "ja": "私たち 都市 川 光 速く 間 人々 水 庭 朝 学ぶ 書く 旅行 音楽 科学 歴史 いつも 決して なぜなら 窓 山 言語 "
    "質問 答え 市場 エネルギー 森 冬 夏".split(),
}
LANGS = ["en"] * 4 + ["de", "fr", "es", "ru", "zh", "ja"]  # mostly English, one sentence in ~2.5 not
MAX_TOKENS = 200


def make_sentences(n: int, seed: int, tokenizer) -> list[str]:
    """n sentences whose word counts are spread log-uniformly from 3 to 150, cut to at most MAX_TOKENS tokens."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        lang = rng.choice(LANGS)
        count = int(round(3 * (50 ** rng.random())))  # 3 .. 150 words, log-uniform
        sep = "" if lang in ("zh", "ja") else " "
        text = sep.join(rng.choice(WORDS[lang]) for _ in range(count))
        ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=MAX_TOKENS - 2)["input_ids"]
        if len(ids) == MAX_TOKENS - 2:  # maybe cut: keep the text of the first tokens
            text = tokenizer.decode(ids)
        texts.append(text[0].upper() + text[1:] + ".")
    return texts


def time_pagedllm(llm, texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, np.array([o.outputs.embedding for o in outs], dtype=np.float32)


def time_st(model, texts: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    emb = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
    return time.perf_counter() - start, emb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM
    from pagedllm.model_loader.resolve import default_embedding_model_path

    path = default_embedding_model_path()
    llm = LLM(path, task="embed", dtype="float32", max_num_seqs=args.batch_size)
    st = SentenceTransformer(path, device="cpu")
    texts = make_sentences(args.num_sentences, args.seed, llm.get_tokenizer())
    num_tokens = sum(len(ids) for ids in llm.get_tokenizer()(texts)["input_ids"])
    time_pagedllm(llm, texts[:64])  # warm-up: first-call allocations, oneDNN kernels
    time_st(st, texts[:64], args.batch_size)
    ours, theirs = [], []
    for _ in range(args.repeats):
        seconds, ours_emb = time_pagedllm(llm, texts)
        ours.append(seconds)
        seconds, st_emb = time_st(st, texts, args.batch_size)
        theirs.append(seconds)
    cosine = (ours_emb * st_emb).sum(1) / np.linalg.norm(ours_emb, axis=1) / np.linalg.norm(st_emb, axis=1)
    ours_rate, st_rate = len(texts) / min(ours), len(texts) / min(theirs)
    record = make_record(
        "cpu-embed-minilm",
        machine_description(),
        git_commit(),
        pagedllm_sentences_s=rounded(ours_rate, 1),
        sentence_transformers_sentences_s=rounded(st_rate, 1),
        ratio=rounded(ours_rate / st_rate, 3),
        pagedllm_seconds=[rounded(s, 3) for s in ours],
        sentence_transformers_seconds=[rounded(s, 3) for s in theirs],
        min_cosine_to_sentence_transformers=rounded(float(cosine.min()), 6),
        num_sentences=len(texts),
        num_tokens=num_tokens,
        batch_size=args.batch_size,
        dtype="float32",
        threads=args.threads,
        seed=args.seed,
    )
    emit(record, append=not args.no_append)


if __name__ == "__main__":
    main()
