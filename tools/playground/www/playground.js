// The rule playground page: hands the two textareas to the engine (core's
// rule engine compiled to WebAssembly, tools/playground/src/lib.rs) and
// renders the JSON it returns. No logic of its own beyond display.
import init, { evaluate, example_config, example_request } from './zerolayer_playground.js';

const $ = (id) => document.getElementById(id);
const config = $('config');
const request = $('request');
const decision = $('decision');
const error = $('error');
let evaluations = 0;

/** An element with optional class, text and children. */
function el(tag, { cls, text, attrs } = {}, ...children) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = String(text);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

const badge = (on) => el('span', { cls: on ? 'badge on' : 'badge off', text: on ? 'ON' : 'off' });
const list = (names) => (names.length ? names.join(', ') : '—');

function showError(kind, path, text) {
  error.replaceChildren(
    el('div', { cls: 'what', text: kind }),
    path ? el('div', {}, 'at ', el('code', { cls: 'path', text: path })) : '',
    el('pre', { text }),
  );
  error.dataset.path = path || '';
  error.hidden = false;
  decision.replaceChildren();
  decision.dataset.ok = 'false';
}

function showDecision(report) {
  error.hidden = true;
  error.replaceChildren();
  error.dataset.path = '';

  const observers = el('table', { attrs: { id: 'observers' } },
    el('thead', {}, el('tr', {}, ...['Observer', 'State', 'Decided by', 'Default'].map((h) => el('th', { text: h })))));
  const obody = el('tbody');
  for (const o of report.observers) {
    obody.append(el('tr', { attrs: { 'data-observer': o.name, 'data-on': String(o.on) } },
      el('td', { text: o.name }),
      el('td', {}, badge(o.on)),
      el('td', { cls: 'decided-by', text: o.decided_by ?? '— (default)' }),
      el('td', { text: o.default ? 'on' : 'off' })));
  }
  observers.append(obody);

  const rules = el('table', { attrs: { id: 'rules' } },
    el('thead', {}, el('tr', {}, ...['#', 'Rule', 'Priority', 'Matched', 'Activates', 'Deactivates', 'Decided']
      .map((h) => el('th', { text: h })))));
  const rbody = el('tbody');
  report.rules.forEach((r, i) => {
    rbody.append(el('tr', { cls: r.matched ? 'matched' : 'unmatched', attrs: { 'data-rule': r.name, 'data-matched': String(r.matched) } },
      el('td', { text: i + 1 }),
      el('td', { cls: 'name', text: r.name }),
      el('td', { text: r.priority }),
      el('td', { text: r.matched ? 'yes' : 'no' }),
      el('td', { text: list(r.activate) }),
      el('td', { text: list(r.deactivate) }),
      el('td', { text: list(r.decides) })));
  });
  rules.append(rbody);

  const req = report.request;
  const t = req.time;
  decision.replaceChildren(
    el('div', { cls: 'published', attrs: { id: 'published' } },
      el('span', { cls: 'muted', text: 'wasmx.zerolayer_observers = ' }), JSON.stringify(report.published)),
    el('h2', { text: 'Observers' }),
    observers,
    el('h2', { text: 'Rules, in decision order' }),
    report.rules.length ? rules : el('p', { cls: 'muted', text: 'No rules: every observer keeps its default.' }),
    el('p', { cls: 'facts', attrs: { id: 'matched' } }, el('b', { text: 'Matched: ' }), list(report.matched)),
    el('p', { cls: 'facts' },
      el('b', { text: 'Tenant: ' }), req.tenant ?? '—', ' · ',
      el('b', { text: 'Request id: ' }), req.request_id ?? '— (percent conditions never match)', ' · ',
      el('b', { text: 'Time: ' }), `${t.utc}${t.time_given ? '' : ' (now)'}, local ${t.local_weekday} ${String(t.local_hour).padStart(2, '0')}h at ${t.utc_offset}`),
  );
  decision.dataset.ok = 'true';
}

function run() {
  evaluations += 1;
  let report;
  try {
    report = JSON.parse(evaluate(config.value, request.value));
  } catch (e) {
    report = { ok: false, error: { kind: 'internal', path: '', text: String(e) } };
  }
  if (report.ok) {
    showDecision(report);
  } else {
    const kind = { config: 'Configuration refused', request: 'Request refused' }[report.error.kind] || 'Error';
    showError(kind, report.error.path, report.error.text);
  }
  document.body.dataset.evaluations = String(evaluations);
}

async function main() {
  try {
    await init();
  } catch (e) {
    showError('Could not load the rule engine', '',
      `${e}\nServe this directory over HTTP (host-sim playground) after cargo xtask build-playground.`);
    return;
  }
  config.value = example_config();
  request.value = example_request();
  config.addEventListener('input', run);
  request.addEventListener('input', run);
  $('evaluate').addEventListener('click', run);
  run();
  document.body.dataset.ready = 'true';
}

main();
