"""The guard: every UserError that stage code builds is either one of the dry run's refusals
(``test_dry_run_refusals.REFUSALS``) or says why it is not (what it depends on besides the recipe)."""

from __future__ import annotations

import ast

from conftest import REPO
from test_dry_run_refusals import REFUSALS

# Where the stages' refusals live: the stages' modules and what only they run (the heads they build, the runtime that
# scores features and decodes the eval, the features they write and read). Not here: the recipe's own schema and
# validators (refused by load_recipe), the target checkpoint's config and weights (mtp_train/models, hf_checkpoint:
# check_inputs and check_recipe read its config.json before any stage), the input data (mtp_train/data: check_data
# runs precompute's checks on the first rows in the dry run), and the slurm command's own options.
STAGE_SOURCES = ("precompute", "eval", "mtp_train/train", "mtp_train/heads", "mtp_train/export.py",
                 "mtp_train/runtime", "mtp_train/features")

# Sites whose refusal the recipe (with the target's config.json, a draft model's, and export's --format) decides:
# each is made by mtp_train.pipeline.check_recipe before any stage runs, and the REFUSALS case named here shows it.
RECIPE_SITES = {
    "eval/loading.py::no_prompt_fits: eval.prompt_sets: no prompt fits the target's {}": "no-room-for-prompts",
    "eval/loading.py::check_recipe: {NO_HELDOUT}": "no-heldout-rows",
    # the same line when the features' manifest holds no held-out row (data.heldout_rows 0 is refused up front)
    "eval/loading.py::heldout_rows: {NO_HELDOUT}": "no-heldout-rows",
    # the schema refuses these first (a Literal, a PositiveInt); the stage keeps them for callers without a recipe
    "eval/prompts.py::load_prompt_set: eval.prompt_sets: unknown prompt set {}; valid s": "prompt-set",
    "eval/prompts.py::load_prompt_set: eval.max_prompts: must be at least 1 (got {})": "max-prompts",
    "mtp_train/heads/base.py::head_spec: head.kind: {} is not a head; choose one of {}": "head-kind",
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head.block_size: {} must be at least 2 (the firs": "block-size",
    # a head as the trainer builds it (pipeline: train/recipe_checks.check_recipe builds it on the meta device)
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head: a dflash head's layers are standard attent": "dflash-mla",
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head.mask_token_id: {} is not an id of the targe":
        "mask-token-id",
    "mtp_train/heads/eagle3.py::Eagle3Head.__init__: head: an eagle3 head has one decoder layer of a": "eagle3-mla",
    "mtp_train/heads/eagle3.py::aux_layers_for: head.aux_layers: {} must be three distinct ascen": "aux-layers",
    "mtp_train/heads/eagle3.py::default_aux_layers: head.aux_layers: the engines' default {} for a {": "aux-default",
    "mtp_train/train/checkpoint.py::target_mtp_layers: {}: eval.draft target_mtp needs a DeepSeek-V3-la":
        "target-mtp",
    "mtp_train/runtime/attention.py::check_latent: target.attention_backend: flashinfer is not wire":
        "flashinfer-mla",
    "mtp_train/runtime/drafters.py::check_draft_vocab: draft model vocab {} differs from the target's {":
        "draft-model-vocab",
    "mtp_train/export.py::check_format: --format {}: {} is a dflash head; it exports for": "export-dflash-sglang",
    "mtp_train/export.py::check_format: --format speculators: {} is an {} head; the spec":
        "export-speculators-mtp",
    "mtp_train/export.py::check_format: --format {}: {} is an {} head with head.window {": "export-window-eagle",
    "mtp_train/export.py::check_format: {}: an mtp head on a {} target cannot be exporte": "export-mtp-llama",
    "mtp_train/export.py::check_format: {}: {}'s EAGLE-1 loader builds a Llama decoder l": "export-eagle-deepseek",
    "mtp_train/export.py::check_format: {}: a {} head on a {} target is not exported for": "export-eagle3-gemma3",
    "mtp_train/export.py::check_format: {}: a dflash head of {} layers cannot be exporte": "export-dflash-layers",
    "mtp_train/export.py::check_format: {}: an mtp head of {} layers cannot be exported": "export-mtp-layers",
    "mtp_train/export.py::check_format: --format sglang: {} is a P-EAGLE head (head.para": "export-peagle-sglang",
}

FEATURES = "the features precompute wrote (manifest, index, shards) or their online plan"
HEAD = "a trained head or checkpoint the train stage wrote"
REPORT = "a report.json an eval wrote (or --baseline names)"
DATA = "the data's rows through the tokenizer (the dry run's check_data makes precompute's on the first rows)"
PROMPTS = "the prompt sets' files and the tokenizer's chat template"
KV = "the sequences' lengths against the KV cache, which is sized on the machine that runs the stage"
IMPORTED = "a head `mtp-train import` wrote (OUTPUT_DIR/imported/NAME)"
INIT_HEAD = ("the head.init_from head's config.json, which another run or `mtp-train import` wrote (check_recipe reads "
             "it before any stage runs, so --dry-run refuses these too: tests/test_init_from.py)")
# Sites whose refusal needs more than the recipe: what an earlier stage wrote, the data, the machine, the launch.
NOT_RECIPE = {
    "precompute/directory.py::prepare_directory: {}: existing features were made with different {": FEATURES,
    "precompute/preflight.py::check_data_files: data.train: {} not found": DATA,
    "precompute/preflight.py::check_rows: data.train: no usable rows": DATA,
    "precompute/preflight.py::mask_counts: {}: the chat template gave an empty loss mask fo": DATA,
    "precompute/readback.py::ShardReadBack.check: rank {}'s shards do not read back as written ({}": "the shards "
        "just written, read back from the filesystem",
    "precompute/run.py::drop_merged: {}: features made with {} are complete here; rer": FEATURES,
    "precompute/run.py::resolve_worker: --rank {} is outside --world-size {}": "the launch: --rank and "
        "--world-size, or the SLURM array's or torchrun's variables",
    "precompute/shards.py::plan_shards: {}: holds rows that no longer match the plan; re": FEATURES,
    "eval/loading.py::baseline_path: {} {}; give the report.json of an earlier eval": REPORT,
    "eval/loading.py::heldout_rows: {} not found; the `heldout` prompt set needs `mt": FEATURES,
    "eval/loading.py::load_other: eval.compare: no {} head in {}; run `mtp-train t": HEAD + " (or imported)",
    "eval/run.py::_compare_id: eval.compare: no {} head in {}; run `mtp-train i": IMPORTED,
    "eval/prompts.py::load_prompt_set: prompt set {}: {} not found (valid sets are {})": PROMPTS,
    "eval/prompts.py::load_prompt_set: prompt set {}: no prompts": PROMPTS,
    "eval/prompts.py::render_prompt: {}: has no chat template to render prompts with": PROMPTS,
    "eval/prompts.py::render_prompt: {}: chat template failed on a prompt: {}": PROMPTS,
    "eval/prompts.py::_read_jsonl: prompt set {}: {} cannot be read: {}": PROMPTS,
    "eval/prompts.py::_field: {}: record {} has no usable {}": PROMPTS,
    "eval/prompts.py::_question_set.build: {}: record {} has a non-string first turn": PROMPTS,
    "eval/prompts.py::_long: {}: record {}'s messages are not chat turns endi": PROMPTS,
    "eval/prompts.py::_heldout: prompt set 'heldout': needs the training rows an": FEATURES,
    "eval/prompts.py::_heldout: prompt set 'heldout': {} held-out row id(s) are": FEATURES,
    "eval/prompts.py::_heldout: prompt set 'heldout': none of the held-out rows": DATA,
    "eval/report.py::load_report: {}: report not found": REPORT,
    "eval/report.py::load_report: {}: is a directory; expected a report.json file": REPORT,
    "eval/report.py::load_report: {}: not a report (not UTF-8 text)": REPORT,
    "eval/report.py::load_report: {}: cannot read the report: {}": REPORT,
    "eval/report.py::load_report: {}: not valid JSON (line {}): {}": REPORT,
    "eval/report.py::load_report: {}: not a report (expected a JSON object, got {}": REPORT,
    "eval/report.py::load_report: {}: not a report (a JSON object without the fiel": REPORT,
    "eval/report.py::load_report: {}: field 'schema_version': report schema {}, th": REPORT,
    "eval/report.py::load_report: {}": REPORT,
    "eval/run.py::_head_id: {}: no trained head in {}; run `mtp-train train`": HEAD,
    "eval/run.py::rerender: {} not found; run `mtp-train eval` first": REPORT,
    "mtp_train/train/checkpoint.py::_corrupt: {}: checkpoint is corrupt or incomplete ({}); de": HEAD,
    "mtp_train/train/checkpoint.py::load_checkpoint: {}: not a checkpoint name ({}); write the name o": HEAD,
    "mtp_train/train/checkpoint.py::load_checkpoint: {}: names {}, which is not a checkpoint director": HEAD,
    "mtp_train/train/checkpoint.py::load_optimizer_shard: {}: the checkpoint's optimizer state is split ov": HEAD,
    "mtp_train/train/checkpoint.py::load_optimizer_shard: {}: the checkpoint was written by DeepSpeed ZeRO": HEAD,
    "mtp_train/train/checkpoint.py::load_optimizer_shard: {}: the checkpoint holds {}'s state and the reci": HEAD,
    "mtp_train/train/checkpoint.py::head_from_hf: {}: head tensor {} is missing": HEAD,
    "mtp_train/train/checkpoint.py::head_from_hf: {}: tensors do not fit the head's config ({})": HEAD,
    "mtp_train/train/checkpoint.py::load_head: {}: head was built for hidden size {} and vocab": HEAD,
    "mtp_train/train/checkpoint.py::load_head: {}: cannot be read ({}); train the head again wi": HEAD,
    "mtp_train/train/checkpoint.py::load_trained_head: {}: the head was trained for a different target": HEAD,
    "mtp_train/train/checkpoint.py::load_target_mtp: {}: MTP layer {} asked for, the checkpoint has {": "the "
        "caller's layer index (the eval asks for layer 0, which target_mtp_layers has found up front)",
    "mtp_train/train/checkpoint.py::load_target_mtp: {}: config.json says {} MTP layer(s), but no ten": "the "
        "target's weights (which tensors the checkpoint holds)",
    "mtp_train/train/trainer.py::TrainInputs.read: {}: the last stored layer must be the target's l": FEATURES,
    "mtp_train/train/checkpoint.py::head_identity: {}: no head here (config.json and model.safetens": INIT_HEAD,
    "mtp_train/train/recipe_checks.py::init_head_spec: head.aux_layers: the features hold {} for this r": INIT_HEAD,
    "mtp_train/train/recipe_checks.py::init_head_spec: head.init_from: {} holds an {} head; set head.ki": INIT_HEAD,
    "mtp_train/train/recipe_checks.py::init_head_spec: head.init_from: {} was built for hidden size {}": INIT_HEAD,
    "mtp_train/train/recipe_checks.py::init_head_spec: head.init_from: {} was trained for another targe": INIT_HEAD
        + ", against " + FEATURES,
    "mtp_train/train/recipe_checks.py::init_head_spec: head.{}: {} is not the head.init_from head's {}": INIT_HEAD,
    "mtp_train/train/trainer.py::Trainer.setup: {}: too few training sequences for {} process(es": FEATURES
        + ", against the processes launched",
    "mtp_train/train/vocab.py::aux_indices: {}: the features hold the outputs of layers {};": FEATURES,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: not a head config (no {} field)": HEAD,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: not a head config ({})": HEAD,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: hidden_input {} / feedback {} are not conven": HEAD,
    "mtp_train/heads/base.py::load_head_config: {} not found; a head checkpoint needs config.jso": HEAD,
    "mtp_train/heads/base.py::load_head_config: {}: invalid JSON ({}); train the head again with": HEAD,
    "mtp_train/heads/base.py::load_head_config: {}: not UTF-8 text; train the head again with `m": HEAD,
    "mtp_train/export.py::export_head: --format {}: choose one of {}": "a caller's format (the CLI's --format "
        "choices refuse another first)",
    "mtp_train/export.py::export_head: {}: no trained {} head; run `mtp-train train` fi": HEAD,
    "mtp_train/export.py::export_head: {}: no head imported there; `mtp-train import RE": IMPORTED + " (export's "
        "--head names it)",
    "mtp_train/export.py::_check_servable: {}/config.json: the head was trained in other co": HEAD + " (the "
        "conventions its config.json records)",
    "mtp_train/export.py::export_head: --format sglang: {} is an eagle3 head with norm_": HEAD + " (its "
        "norm_before_residual, which only an imported head has)",
    "mtp_train/runtime/attention.py::backend_name: target.attention_backend: flashinfer needs a CUD": "the machine "
        "(a CUDA device)",
    "mtp_train/runtime/attention.py::backend_name: target.attention_backend: flashinfer could not b": "the machine "
        "(nvcc, or prebuilt kernels)",
    "mtp_train/runtime/drafters.py::BlockDrafter.block_logits: eval.k: k = {} drafts past what the dflash head": HEAD
        + " (its block_size; the recipe's eval.k against head.block_size is a recipe validator)",
    "mtp_train/runtime/drafters.py::ParallelDrafter.block_logits: eval.k: k = {} drafts past the {} a P-EAGLE head": HEAD
        + " (its parallel_drafts; the recipe's eval.k against head.parallel_drafts is a recipe validator)",
    "mtp_train/runtime/engine.py::kv_budget: target.gpu_memory_fraction: {} of {} GiB leaves": "the machine (the "
        "GPU's memory and the weights loaded on it)",
    "mtp_train/runtime/engine.py::Engine._score: sequence {} ({} tokens) does not fit the KV cach": KV,
    "mtp_train/runtime/scheduler.py::Scheduler.add: request {}: {} tokens (prompt plus max_new_token": KV,
    "mtp_train/runtime/speculative.py::SpeculativeDecoder.generate: request {}: too long for the KV cache with a dra":
        KV,
    "mtp_train/features/index.py::load_index: {}: missing (the features' per-sequence index);": FEATURES,
    "mtp_train/features/index.py::load_index: {}: unreadable index ({}); rerun precompute with": FEATURES,
    "mtp_train/features/index.py::load_index: {}: not a features index (no {}); rerun precompu": FEATURES,
    "mtp_train/features/index.py::load_index: {}: its shards do not match the manifest's; reru": FEATURES,
    "mtp_train/features/index.py::load_index: {}: its sequences' tokens do not add up to the m": FEATURES,
    "mtp_train/features/manifest.py::union: {}: fingerprint differs from {}'s; these ranks r": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest ({}); rerun precompu": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest (not a JSON object);": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: features format {} is not this toolkit's for": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest (field {}: {}); reru": FEATURES,
    "mtp_train/features/online.py::open_features: {}: the features were {}, and the recipe says pr": FEATURES,
    "mtp_train/features/online.py::OnlineFeatures.__init__: {}: not a complete online plan; rerun `mtp-train":
        FEATURES,
    "mtp_train/features/online.py::OnlineFeatures.__init__: {}: features were planned for a different target":
        FEATURES,
    "mtp_train/features/planned_rows.py::DataRows.__init__: data.train: {} not found": DATA,
    "mtp_train/features/planned_rows.py::DataRows.__init__: {}: cannot detect the row format from columns {}": DATA,
    "mtp_train/features/planned_rows.py::DataRows.contents: data.train: row {} of the online plan is gone or": DATA,
    "mtp_train/features/planned_rows.py::PlannedRows.__init__: {}: the plan was made from other {} than the rec":
        FEATURES,
    "mtp_train/features/planned_rows.py::PlannedRows.encode_checked: {}: {} encode to other lengths than the plan rec":
        FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: features are incomplete; rerun precompute to": FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: these features are planned for online traini": FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: features were computed from a different targ":
        FEATURES,
    "mtp_train/features/reader.py::FeatureReader._file: {}: {} is {}, other shards have {}": FEATURES,
    "mtp_train/features/reader.py::damaged: {}: {}; check the features with `mtp-train verif": FEATURES,
    "mtp_train/features/space.py::require_space: {}: {} need {}, but the filesystem of {} has {}": "the filesystem's "
        "free space (the dry run's check_data measures it when precompute is planned)",
    "mtp_train/features/verify.py::load_features_manifest: {}: features directory not found": FEATURES,
    "mtp_train/features/verify.py::load_features_manifest: {}: no manifest.json or manifest.rank-*.json; ru":
        FEATURES,
}


def _message_template(node: ast.expr) -> str:
    """A message as its source spells it: literal text kept, an f-string's fields as ``{}``, a name as ``{NAME}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_template(node.left) + _message_template(node.right)
    return f"{{{node.id}}}" if isinstance(node, ast.Name) else "{}"


def user_error_sites() -> list[str]:
    """Every ``UserError(...)`` built in ``STAGE_SOURCES``, as ``path::function: message`` (its first 48
    characters): a key that survives moved lines and names what a reader looks for."""
    sites = []
    for source in STAGE_SOURCES:
        root = REPO / source
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            scopes: list[str] = []

            def visit(node: ast.AST) -> None:
                named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if named:
                    scopes.append(node.name)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "UserError":
                    message = _message_template(node.args[0]) if node.args else ""
                    where = ".".join(scopes) or "<module>"
                    sites.append(f"{path.relative_to(REPO)}::{where}: {message[:48].rstrip()}")
                for child in ast.iter_child_nodes(node):
                    visit(child)
                if named:
                    scopes.pop()

            visit(ast.parse(path.read_text(encoding="utf-8")))
    return sites


def test_every_refusal_in_stage_code_is_one_the_dry_run_makes_or_says_why_not():
    """The guard. A refusal a stage makes from the recipe alone belongs in ``mtp_train.pipeline.check_recipe`` (or a
    recipe validator), so that ``--dry-run`` and the start of every run make it before any stage runs; but nothing can
    tell from the code whether a new check reads only the recipe. So every ``UserError`` that stage code builds
    (``STAGE_SOURCES``; found by parsing the sources, keyed by file, function and the start of its message) must be
    classified here: in ``RECIPE_SITES``, naming the ``REFUSALS`` case that shows the dry run (and the run, before its
    first stage) refusing it, or in ``NOT_RECIPE``, with what else it depends on (what an earlier stage wrote, the data,
    the machine, the launch). A new site fails this test until its author decides which, in review's sight; an entry
    whose site is gone or reworded fails it too, so the lists stay true. It cannot catch a recipe-only check written
    as another exception or in a module outside ``STAGE_SOURCES``."""
    sites = user_error_sites()
    twins = sorted({s for s in sites if sites.count(s) > 1})
    assert not twins, f"sites that share a key (make their messages differ in the first 48 characters): {twins}"
    assert not RECIPE_SITES.keys() & NOT_RECIPE.keys()
    new = sorted(set(sites) - RECIPE_SITES.keys() - NOT_RECIPE.keys())
    assert not new, (
        "UserError sites in stage code that the dry-run tests do not know:\n  " + "\n  ".join(new) + "\nIf the recipe "
        "(with the target's config.json) alone decides one, make the stage's check callable before anything runs "
        "(a validator in mtp_train/recipe.py for a relation between fields, else the stage's check_recipe, which "
        "mtp_train.pipeline.check_recipe calls), add a REFUSALS case and map the site to it in RECIPE_SITES; "
        "otherwise add it to NOT_RECIPE with what it depends on besides the recipe.")
    gone = sorted((RECIPE_SITES.keys() | NOT_RECIPE.keys()) - set(sites))
    assert not gone, "entries whose UserError is no longer in stage code (moved, reworded or removed):\n  " + \
        "\n  ".join(gone)
    cases = {case.id for case in REFUSALS}
    assert set(RECIPE_SITES.values()) <= cases, set(RECIPE_SITES.values()) - cases
