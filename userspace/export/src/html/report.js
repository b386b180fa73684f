// allocbpf's HTML report: draws the page from the JSON document embedded in it.
// Self-contained on purpose: no library, no request (the page's Content-Security-Policy
// forbids any), every name from the profile set as text, never as markup (names come
// from other processes' symbol tables and are hostile input).
'use strict';
(function () {
  const data = JSON.parse(document.getElementById('allocbpf-data').textContent);
  const names = data.names;
  const SVG = 'http://www.w3.org/2000/svg';
  // The most rows a table draws at once; the rest are counted (a page of ten thousand
  // stacks stays quick).
  const TABLE_ROWS = 200;
  // Frames narrower than this many pixels are not drawn (their parent's width shows them).
  const MIN_FRAME_PX = 0.5;
  // Frames narrower than this are painted on a canvas, not made DOM nodes: a page of
  // thousands of thin stacks would otherwise lay out tens of thousands of elements.
  // They are too thin for a name; hovering and clicking them still work.
  const DOM_FRAME_PX = 6;
  const ROW_PX = 18;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === 'text') node.textContent = value;
      else if (key === 'class') node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) if (child) node.appendChild(child);
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === 'text') node.textContent = value;
      else node.setAttribute(key, value);
    }
    return node;
  }

  function bytes(b) {
    if (b === null || b === undefined) return '—';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    let v = Math.abs(b);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    const shown = i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1);
    return (b < 0 ? '-' : '') + shown + ' ' + units[i];
  }

  function interval(ci) {
    return ci ? bytes(ci[0]) + ' – ' + bytes(ci[1]) : '—';
  }

  function seconds(s) {
    return s < 10 ? s.toFixed(2) + ' s' : s.toFixed(1) + ' s';
  }

  const level = data.confidence + '%';
  // Observed part time (an overhead budget): a stack's interval covers byte sampling in
  // the observed windows, scaled up (the header's total covers time sampling too).
  const partTime = data.time_sampled !== null && data.time_sampled < 1;
  const stackCI = level + (partTime ? ' CI (observed windows)' : ' CI');

  // ---- Header -------------------------------------------------------------------
  function renderHeader() {
    const t = data.totals;
    const facts = [
      ['command', data.command],
      ['mean sampling interval', bytes(data.rate)],
      ['duration', seconds(data.duration_s)],
      ['processes', String(data.processes.length)],
      ['estimated allocated', bytes(t.bytes) + ' (' + level + ' CI ' + interval(t.ci) + ')'],
      ['exactly counted', bytes(t.exact_bytes) + ' in ' + t.exact_calls + ' calls'],
      ['samples', t.samples + ' (' + t.drops + ' dropped, ' + t.without_stack + ' without stack)'],
    ];
    if (data.live) facts.push(['in use at the end', bytes(t.inuse)]);
    if (data.time_sampled !== null) {
      facts.push(['observed', (100 * data.time_sampled).toFixed(2) + '% of the time (overhead budget)']);
    }
    const list = el('dl', { class: 'facts' });
    for (const [key, value] of facts) {
      list.appendChild(el('dt', { text: key }));
      list.appendChild(el('dd', { text: value }));
    }
    const notes = el('ul', { class: 'notes' });
    for (const line of data.summary) notes.appendChild(el('li', { text: line }));
    const header = document.getElementById('header');
    header.appendChild(el('h1', { text: 'allocbpf: heap allocation profile' }));
    header.appendChild(list);
    header.appendChild(el('details', {}, el('summary', { text: 'what was counted, and what was not seen' }), notes));
  }

  // ---- Flame graph ----------------------------------------------------------------
  const flame = { view: 'alloc', icicle: false, zoom: 0, search: '' };
  let tree = null;

  // One tree for both views: allocated bytes, or (with --live) bytes in use, whose
  // nodes holding nothing are left out.
  function buildTree(view) {
    const t = data.tree;
    const alloc = view === 'alloc';
    const v = {
      name: t.name, parent: t.parent, samples: t.samples,
      value: alloc ? t.value : t.inuse,
      lo: alloc ? t.lo : t.inuse_lo,
      hi: alloc ? t.hi : t.inuse_hi,
    };
    const n = v.name.length;
    const children = Array.from({ length: n }, () => []);
    const depth = new Array(n).fill(0);
    let maxDepth = 0;
    for (let i = 1; i < n; i++) {
      if (v.value[i] <= 0) continue;
      children[v.parent[i]].push(i);
      depth[i] = depth[v.parent[i]] + 1;
      if (depth[i] > maxDepth) maxDepth = depth[i];
    }
    for (const list of children) list.sort((a, b) => v.value[b] - v.value[a]);
    return { v, children, depth, maxDepth };
  }

  function nameOf(node) {
    return names[tree.v.name[node]];
  }

  function color(name) {
    let h = 0;
    for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
    return 'hsl(' + (10 + (h % 40)) + ',' + (70 + (h >> 8) % 20) + '%,' + (55 + (h >> 16) % 15) + '%)';
  }

  // The thin frames painted on the canvas, per depth, left to right: [x, width, node].
  let thin = [];

  function renderFlame() {
    tree = buildTree(flame.view);
    const graph = document.getElementById('flame-graph');
    graph.textContent = '';
    const width = graph.clientWidth || 1200;
    const v = tree.v;
    const rows = tree.maxDepth + 1;
    graph.style.height = (rows * ROW_PX) + 'px';
    const query = flame.search.toLowerCase();
    let matched = 0;
    const top = (d) => (flame.icicle ? d : rows - 1 - d) * ROW_PX;
    const ratio = window.devicePixelRatio || 1;
    const canvas = el('canvas', { class: 'thin-frames' });
    canvas.width = Math.ceil(width * ratio);
    canvas.height = Math.ceil(rows * ROW_PX * ratio);
    canvas.style.width = width + 'px';
    canvas.style.height = (rows * ROW_PX) + 'px';
    graph.appendChild(canvas);
    const paint = canvas.getContext('2d');
    paint.scale(ratio, ratio);
    thin = Array.from({ length: rows }, () => []);
    const frame = (node, x, w, dim) => {
      const name = nameOf(node);
      if (w < DOM_FRAME_PX && !dim) {
        const isMatch = query && name.toLowerCase().includes(query);
        paint.fillStyle = isMatch ? '#e040e0' : color(name);
        paint.fillRect(x, top(tree.depth[node]), Math.max(w - 0.5, 0.5), ROW_PX - 1);
        thin[tree.depth[node]].push([x, w, node]);
        return;
      }
      const div = el('div', { class: 'frame' });
      div.dataset.node = node;
      div.style.left = x + 'px';
      div.style.width = Math.max(w - 1, 0.5) + 'px';
      div.style.top = top(tree.depth[node]) + 'px';
      div.style.background = color(name);
      if (dim) div.classList.add('ancestor');
      if (node === flame.zoom) div.classList.add('zoomed');
      if (query && name.toLowerCase().includes(query)) div.classList.add('match');
      if (w > 24) div.textContent = name;
      graph.appendChild(div);
    };
    // Ancestors of the zoomed node: full width, dimmed.
    for (let a = v.parent[flame.zoom]; a >= 0; a = v.parent[a]) frame(a, 0, width, true);
    const scale = width / Math.max(v.value[flame.zoom], 1);
    // Matched bytes: the outermost matching frames under the zoomed node.
    const walk = (node, x, inMatch) => {
      const w = v.value[node] * scale;
      const isMatch = query !== '' && nameOf(node).toLowerCase().includes(query);
      if (isMatch && !inMatch) matched += v.value[node];
      if (w >= MIN_FRAME_PX) frame(node, x, w, false);
      else if (!query) return;
      let cx = x;
      for (const child of tree.children[node]) {
        walk(child, cx, inMatch || isMatch);
        cx += v.value[child] * scale;
      }
    };
    walk(flame.zoom, 0, false);
    const info = document.getElementById('flame-info');
    if (v.value[0] <= 0) {
      info.textContent = flame.view === 'alloc' ? 'nothing was sampled' : 'nothing sampled was in use at the end';
      return;
    }
    info.textContent = query
      ? 'matched ' + bytes(matched) + ' (' + (100 * matched / Math.max(v.value[flame.zoom], 1)).toFixed(1) + '% of the view)'
      : (flame.zoom ? 'zoomed on ' + nameOf(flame.zoom) + ': click "all" to reset' : 'click a frame to zoom');
  }

  // The node under the pointer: a DOM frame's, or a thin frame's on the canvas.
  function nodeAt(event) {
    const target = event.target;
    if (target.classList && target.classList.contains('frame')) return Number(target.dataset.node);
    if (target.tagName !== 'CANVAS') return null;
    const box = target.getBoundingClientRect();
    const x = event.clientX - box.left;
    const row = Math.floor((event.clientY - box.top) / ROW_PX);
    const depth = flame.icicle ? row : thin.length - 1 - row;
    const frames = thin[depth] || [];
    // Left to right: the last frame starting at or before x.
    let lo = 0, hi = frames.length - 1, found = null;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (frames[mid][0] <= x) { found = frames[mid]; lo = mid + 1; } else { hi = mid - 1; }
    }
    return found && x <= found[0] + found[1] ? found[2] : null;
  }

  function showTooltip(event) {
    const tip = document.getElementById('tooltip');
    const node = nodeAt(event);
    if (node === null) { tip.hidden = true; return; }
    const v = tree.v;
    const root = Math.max(v.value[0], 1);
    tip.textContent = '';
    tip.appendChild(el('b', { text: nameOf(node) }));
    const what = flame.view === 'alloc' ? 'allocated' : 'in use';
    const ci = v.lo[node] === null ? null : [v.lo[node], v.hi[node]];
    tip.appendChild(el('div', { text: 'estimated ' + what + ': ' + bytes(v.value[node]) + ' (' + (100 * v.value[node] / root).toFixed(2) + '%)' }));
    tip.appendChild(el('div', { text: stackCI + ': ' + interval(ci) }));
    tip.appendChild(el('div', { text: 'samples (allocated): ' + v.samples[node] }));
    tip.hidden = false;
    tip.style.left = Math.min(event.pageX + 12, document.body.scrollWidth - 320) + 'px';
    tip.style.top = (event.pageY + 12) + 'px';
  }

  function setupFlame() {
    const graph = document.getElementById('flame-graph');
    graph.addEventListener('click', (event) => {
      const node = nodeAt(event);
      if (node === null) return;
      flame.zoom = node;
      renderFlame();
    });
    graph.addEventListener('mousemove', showTooltip);
    graph.addEventListener('mouseleave', () => { document.getElementById('tooltip').hidden = true; });
    document.getElementById('search').addEventListener('input', (event) => {
      flame.search = event.target.value;
      renderFlame();
    });
    for (const button of document.querySelectorAll('[data-view]')) {
      if (button.dataset.view === 'inuse' && !data.tree.inuse) { button.disabled = true; button.title = 'run with --live'; }
      button.addEventListener('click', () => {
        flame.view = button.dataset.view;
        flame.zoom = 0;
        renderFlame();
        markButtons();
      });
    }
    for (const button of document.querySelectorAll('[data-layout]')) {
      button.addEventListener('click', () => {
        flame.icicle = button.dataset.layout === 'icicle';
        renderFlame();
        markButtons();
      });
    }
    document.getElementById('reset').addEventListener('click', () => { flame.zoom = 0; renderFlame(); });
    markButtons();
  }

  function markButtons() {
    for (const b of document.querySelectorAll('[data-view]')) b.classList.toggle('on', b.dataset.view === flame.view);
    for (const b of document.querySelectorAll('[data-layout]')) b.classList.toggle('on', (b.dataset.layout === 'icicle') === flame.icicle);
  }

  // ---- Timeline -------------------------------------------------------------------
  function chart(title, points, pick, marks) {
    const W = 900, H = 180, L = 80, B = 24, T = 22;
    const box = svg('svg', { viewBox: '0 0 ' + W + ' ' + (H + T + B), class: 'chart', role: 'img', 'aria-label': title });
    box.appendChild(svg('text', { x: L, y: 14, class: 'title', text: title }));
    const t0 = points.length ? points[0][0] : 0;
    const t1 = points.length ? points[points.length - 1][1] : 1;
    let ymax = 1;
    for (const p of points) {
      const [v, , hi] = pick(p);
      ymax = Math.max(ymax, hi === null ? v : hi, v);
    }
    for (const m of marks) ymax = Math.max(ymax, m[1]);
    const x = (t) => L + (W - L - 10) * (t - t0) / Math.max(t1 - t0, 1e-9);
    const y = (b) => T + H - H * b / ymax;
    for (let i = 0; i <= 4; i++) {
      const b = ymax * i / 4;
      box.appendChild(svg('line', { x1: L, x2: W - 10, y1: y(b), y2: y(b), class: 'grid' }));
      box.appendChild(svg('text', { x: L - 6, y: y(b) + 4, class: 'axis', 'text-anchor': 'end', text: bytes(b) }));
    }
    for (let i = 0; i <= 5; i++) {
      const t = t0 + (t1 - t0) * i / 5;
      box.appendChild(svg('text', { x: x(t), y: T + H + 16, class: 'axis', 'text-anchor': 'middle', text: seconds(t) }));
    }
    const upper = [], lower = [], line = [];
    for (const p of points) {
      const [v, lo, hi, at] = pick(p);
      if (v === null) continue;
      for (const t of at) {
        line.push(x(t) + ',' + y(v));
        if (lo !== null) { upper.push(x(t) + ',' + y(hi)); lower.push(x(t) + ',' + y(lo)); }
      }
    }
    if (upper.length) box.appendChild(svg('polygon', { points: upper.concat(lower.reverse()).join(' '), class: 'band' }));
    box.appendChild(svg('polyline', { points: line.join(' '), class: 'estimate' }));
    for (const [t, b, label] of marks) {
      box.appendChild(svg('circle', { cx: x(t), cy: y(b), r: 5, class: 'peak' }));
      box.appendChild(svg('text', { x: Math.min(x(t) + 8, W - 200), y: Math.max(y(b) - 6, T + 10), class: 'peak-label', text: label }));
    }
    return box;
  }

  function renderTimeline(index) {
    const area = document.getElementById('timeline-charts');
    area.textContent = '';
    const held = document.getElementById('peak-stacks');
    held.textContent = '';
    const timeline = data.timelines[index];
    if (!timeline) {
      area.appendChild(el('p', { text: 'no timeline was recorded' }));
      return;
    }
    const pts = timeline.points;
    if (!pts.length) {
      area.appendChild(el('p', { class: 'muted', text: 'no timestamped sample in this process (a runtime\'s own counts, as Go\'s heap profile, are not in the timeline)' }));
      return;
    }
    // Allocation rate: bytes per second of each point, a step per point.
    const rateTitle = timeline.time_sampled
      ? 'allocation rate (bytes/s), scaled up from observation windows'
      : 'allocation rate (bytes/s), pointwise ' + level + ' band';
    if (timeline.time_sampled) {
      area.appendChild(el('p', { class: 'muted', text: 'observed part time (overhead budget): each point is scaled up from its observation windows and has no band of its own; the header\'s total interval covers time sampling' }));
    }
    area.appendChild(chart(rateTitle, pts, (p) => {
      // At least a millisecond: a point cut short at the run's end is not a spike.
      const d = Math.max(p[1] - p[0], 1e-3);
      return [p[2] / d, p[3] === null ? null : p[3] / d, p[4] === null ? null : p[4] / d, [p[0], p[1]]];
    }, []));
    if (timeline.time_sampled) {
      area.appendChild(el('p', { class: 'muted', text: 'heap in use: not followed under the overhead budget (a block leaves the followed set when its observation window closes, not when it is freed); profile one process by --pid with --live to follow it' }));
    } else if (timeline.live) {
      const marks = [];
      if (timeline.high) marks.push([timeline.high[0], timeline.high[1], 'highest estimate ' + bytes(timeline.high[1]) + ' at ' + seconds(timeline.high[0])]);
      area.appendChild(chart('estimated heap in use, pointwise ' + level + ' band', pts, (p) => [p[5], p[6], p[7], [p[1]]], marks));
    } else {
      area.appendChild(el('p', { class: 'muted', text: 'heap in use: run with --live to follow it' }));
    }
    const peak = timeline.peak;
    if (!peak) return;
    held.appendChild(el('h3', { text: 'held at the peak (a moment within 2% of the highest estimate): ' + bytes(peak.bytes) + ' (' + level + ' CI ' + interval(peak.ci) + ') at ' + seconds(peak.at_s) }));
    const rows = peak.stacks.map((s) => ({ frames: s.frames, bytes: s.bytes, ci: s.ci, samples: s.samples }));
    held.appendChild(stackTable(rows, [
      ['site', (r) => leaf(r.frames), null],
      ['stack', (r) => stackText(r.frames), null],
      ['held', (r) => bytes(r.bytes), (r) => r.bytes],
      [level + ' CI', (r) => interval(r.ci), null],
      ['samples', (r) => String(r.samples), (r) => r.samples],
    ], 2, peak.more));
  }

  function setupTimeline() {
    const select = document.getElementById('timeline-process');
    const order = data.timelines.map((t, i) => [i, t.points.reduce((s, p) => s + p[2], 0)]).sort((a, b) => b[1] - a[1]);
    for (const [i] of order) select.appendChild(el('option', { value: String(i), text: data.timelines[i].name }));
    select.addEventListener('change', () => renderTimeline(Number(select.value)));
    if (data.timelines_omitted) {
      select.parentNode.appendChild(el('span', { class: 'muted', text: ' the ' + data.timelines.length + ' processes that allocated most; ' + data.timelines_omitted + ' more not shown' }));
    }
    renderTimeline(order.length ? order[0][0] : -1);
  }

  // ---- Tables ---------------------------------------------------------------------
  // A stack's frames (name indexes, outermost first) from its leaf node: the path up to
  // its process's node.
  function framesOf(node) {
    const t = data.tree;
    const frames = [];
    for (let n = node; n > 0 && t.parent[n] !== 0; n = t.parent[n]) frames.push(t.name[n]);
    return frames.reverse();
  }
  for (const stack of data.stacks) stack.frames = framesOf(stack.node);

  function leaf(frames) {
    return frames.length ? names[frames[frames.length - 1]] : '(no frame)';
  }

  function stackText(frames) {
    return frames.map((f) => names[f]).join(' → ');
  }

  // A table of `rows` with `columns` ([title, text, sort key or null]), sortable by
  // clicking a sortable column's title; `sorted`: the column sorted by at first.
  function stackTable(rows, columns, sorted, more) {
    const wrap = el('div', { class: 'table' });
    const state = { column: sorted, descending: true };
    const draw = () => {
      wrap.textContent = '';
      const key = columns[state.column][2];
      const ordered = rows.slice().sort((a, b) => (state.descending ? key(b) - key(a) : key(a) - key(b)));
      const table = el('table');
      const head = el('tr');
      columns.forEach(([title, , sortKey], i) => {
        const th = el('th', { text: title + (i === state.column ? (state.descending ? ' ▼' : ' ▲') : '') });
        if (sortKey) {
          th.classList.add('sortable');
          th.addEventListener('click', () => {
            state.descending = state.column === i ? !state.descending : true;
            state.column = i;
            draw();
          });
        }
        head.appendChild(th);
      });
      table.appendChild(el('thead', {}, head));
      const body = el('tbody');
      for (const row of ordered.slice(0, TABLE_ROWS)) {
        const tr = el('tr');
        columns.forEach(([, text], i) => {
          const td = el('td', { text: text(row) });
          if (i === 1 && row.frames) td.title = stackText(row.frames);
          tr.appendChild(td);
        });
        body.appendChild(tr);
      }
      table.appendChild(body);
      wrap.appendChild(table);
      const hidden = Math.max(ordered.length - TABLE_ROWS, 0) + (more || 0);
      if (hidden) wrap.appendChild(el('p', { class: 'muted', text: hidden + ' more not shown' }));
    };
    draw();
    return wrap;
  }

  function processName(pid) {
    const p = data.processes.find((q) => q.pid === pid);
    return p ? p.name : 'pid ' + pid;
  }

  function renderTables() {
    const columns = [
      ['process', (r) => processName(r.pid), null],
      ['site', (r) => leaf(r.frames), null],
      ['stack (outermost first)', (r) => stackText(r.frames), null],
      ['estimated', (r) => bytes(r.bytes), (r) => r.bytes],
      [stackCI, (r) => interval(r.ci), null],
      ['samples', (r) => String(r.samples), (r) => r.samples],
    ];
    if (data.live) {
      columns.push(['in use', (r) => bytes(r.inuse), (r) => r.inuse]);
      columns.push(['in use ' + level + ' CI', (r) => interval(r.inuse_ci), null]);
    }
    document.getElementById('stacks').appendChild(stackTable(data.stacks, columns, 3, 0));
    const processColumns = [
      ['process', (r) => r.name, null],
      ['estimated', (r) => bytes(r.bytes), (r) => r.bytes],
      [stackCI, (r) => interval(r.ci), null],
      ['samples', (r) => String(r.samples), (r) => r.samples],
      ['exact bytes', (r) => bytes(r.exact_bytes), (r) => r.exact_bytes],
      ['exact calls', (r) => String(r.exact_calls), (r) => r.exact_calls],
      ['observed', (r) => (r.observed === null || r.observed === undefined ? 'all the time' : (100 * r.observed).toFixed(2) + '%'), (r) => (r.observed === null || r.observed === undefined ? 1 : r.observed)],
    ];
    if (data.live) processColumns.push(['in use', (r) => bytes(r.inuse), (r) => r.inuse]);
    document.getElementById('processes').appendChild(stackTable(data.processes, processColumns, 1, 0));
  }

  renderHeader();
  setupFlame();
  renderFlame();
  setupTimeline();
  renderTables();
  window.addEventListener('resize', renderFlame);
  // What the browser tests and the benchmark read: when the page was drawn, and when
  // that drawing was first painted (the frame after the next: its paint is done).
  // thinFrame(i): the i-th frame painted on the canvas, as [x, y] of its middle in the
  // viewport and its node (null past the last).
  const thinFrame = (i) => {
    const all = thin.flatMap((row, depth) => row.map((f) => [f, depth]));
    if (i >= all.length) return null;
    const [[x, w, node], depth] = all[i];
    const box = document.querySelector('#flame-graph canvas').getBoundingClientRect();
    const row = flame.icicle ? depth : thin.length - 1 - depth;
    return [box.left + x + w / 2, box.top + row * ROW_PX + ROW_PX / 2, node];
  };
  window.allocbpf = { drawnAt: performance.now(), paintedAt: null, state: () => Object.assign({}, flame), thinFrame };
  requestAnimationFrame(() => requestAnimationFrame(() => { window.allocbpf.paintedAt = performance.now(); }));
})();
