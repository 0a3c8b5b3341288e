# ruff: noqa: E501  (the embedded script keeps one statement group per line)
"""The graph view's script and style (plain ES5 written for fxforge, no library): report/graph_view.py inlines them.

The script reads the view's JSON (report/hierarchy.py), sizes every open group from its children and the
layered layout computed in Python, draws the SVG (frames for open groups, boxes for closed groups and nodes,
edges through the layout's bend points), and handles clicks (a closed group opens, an open group's title
closes it, a node shows its details), wheel zoom, drag pan, search by name and the overlay menu. All text is
set with ``textContent``: names from a checkpoint never become markup.
"""

from __future__ import annotations

__all__ = ["GRAPH_VIEW_CSS", "GRAPH_VIEW_JS"]

GRAPH_VIEW_CSS = """
.fxg{border:1px solid #ccc;font:12px system-ui,sans-serif;position:relative}
.fxg-bar{display:flex;flex-wrap:wrap;gap:.6em;align-items:center;padding:4px 6px;background:#f6f6f6}
.fxg-canvas{height:70vh;overflow:hidden;cursor:grab;background:#fff}.fxg-svg{width:100%;height:100%}
.fxg-legend{padding:2px 6px;min-height:1.4em}.fxg-legend span{display:inline-block;margin-right:.8em}
.fxg-legend i{display:inline-block;width:12px;height:12px;border:1px solid #999;vertical-align:middle;margin-right:3px}
.fxg-ramp{display:inline-block;width:160px;height:12px;vertical-align:middle;border:1px solid #999}
.fxg-detail{white-space:pre-wrap;font-family:ui-monospace,monospace;padding:4px 6px;background:#fafafa;
max-height:12em;overflow:auto}.fxg-box{cursor:pointer}.fxg-box text,.fxg-frame text{pointer-events:none}
.fxg-match rect{stroke:#e91e63;stroke-width:3}.fxg-head{cursor:pointer}
"""

GRAPH_VIEW_JS = r"""
window.fxforgeGraphView = window.fxforgeGraphView || function(root){
  var t0 = performance.now();
  var data = JSON.parse(root.querySelector('script.fxg-data').textContent);
  var items = data.items, open = {}, geo = {}, abs = {};
  var NW = 156, NH = 34, GH = 40, PAD = 12, HEAD = 22, SLOT = NW + 26, ROWGAP = 34, DW = 6;
  var svg = root.querySelector('svg.fxg-svg'), vp = svg.querySelector('g.fxg-vp'), NS = svg.namespaceURI;
  var select = root.querySelector('select.fxg-overlay'), search = root.querySelector('input.fxg-search');
  var legend = root.querySelector('.fxg-legend'), detail = root.querySelector('.fxg-detail');
  var found = root.querySelector('.fxg-found'), view = {k: 1, x: 0, y: 0}, matches = {};
  var KIND = {placeholder: '#c8e6c9', get_attr: '#eeeeee', module: '#bbdefb', module_related_func: '#b3e5fc',
              builtin_func: '#fff9c4', output: '#ffcdd2'};
  var RAMP = ['#fde725', '#5ec962', '#21918c', '#3b528b', '#440154'];
  data.expanded.forEach(function(id){ open[id] = true; });
  var overlays = {}; data.overlays.forEach(function(o){ overlays[o.key] = o; });

  function el(tag, attrs, parent){ var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
  function clip(s, n){ s = String(s); return s.length > n ? s.slice(0, n - 1) + '\u2026' : s; }
  function fmt(v){ if (v === undefined) return 'n/a'; var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-2)) return v.toExponential(2); return String(+v.toPrecision(4)); }
  function isOpen(id){ return items[id].kind === 'group' && open[id]; }

  function measure(id){
    var it = items[id];
    if (!isOpen(id)) return (geo[id] = {w: NW, h: it.kind === 'group' ? GH : NH});
    var L = it.layout, pos = {}, y = HEAD + PAD, minX = Infinity, maxX = -Infinity;
    L.rows.forEach(function(row){
      var size = {}, rh = 0, right = -Infinity;
      row.forEach(function(c){ size[c] = c.charAt(0) === '~' ? {w: DW, h: 0} : measure(c); rh = Math.max(rh, size[c].h); });
      row.forEach(function(c){
        var x = Math.max(L.x[c] * SLOT - size[c].w / 2, right + (c.charAt(0) === '~' ? 4 : 18));
        pos[c] = {x: x, y: y + (rh - size[c].h) / 2, w: size[c].w, h: size[c].h};
        right = x + size[c].w; minX = Math.min(minX, x); maxX = Math.max(maxX, right);
      });
      y += rh + ROWGAP;
    });
    if (minX === Infinity) { minX = 0; maxX = NW; }
    for (var c in pos) pos[c].x += PAD - minX;
    return (geo[id] = {w: Math.max(maxX - minX + 2 * PAD, NW), h: y - ROWGAP + PAD, pos: pos});
  }
  function place(id, x, y){
    var g = geo[id]; abs[id] = {x: x, y: y, w: g.w, h: g.h};
    if (g.pos) for (var c in g.pos) {
      if (c.charAt(0) === '~') abs[id + ' ' + c] = {x: x + g.pos[c].x, y: y + g.pos[c].y, w: DW, h: 0};
      else place(c, x + g.pos[c].x, y + g.pos[c].y);
    }
  }

  function scale(key){
    var o = overlays[key], vals = [];
    if (!o) return null;
    Object.keys(abs).forEach(function(id){ var it = items[id];
      if (it && (!isOpen(id)) && it.values[key] !== undefined) vals.push(it.values[key]); });
    var f = function(v){ return o.log ? Math.log(Math.max(v, 1e-12)) : v; };
    var lo = Math.min.apply(null, vals.map(f)), hi = Math.max.apply(null, vals.map(f));
    var colour = function(v){
      if (v === undefined) return '#f2f2f2';
      var t = hi > lo ? (f(v) - lo) / (hi - lo) : 0.5, k = Math.min(3.999, t * 4), i = Math.floor(k);
      return mix(RAMP[i], RAMP[i + 1], k - i);
    };
    return {o: o, vals: vals, colour: colour, lo: lo, hi: hi, inv: function(u){ return o.log ? Math.exp(u) : u; }};
  }
  function mix(a, b, t){ var p = function(h, i){ return parseInt(h.substr(1 + 2 * i, 2), 16); }, out = '#';
    for (var i = 0; i < 3; i++) { var v = Math.round(p(a, i) * (1 - t) + p(b, i) * t); out += (v < 16 ? '0' : '') + v.toString(16); }
    return out; }
  function ink(fill){ var v = parseInt(fill.substr(1), 16), r = v >> 16, g = (v >> 8) & 255, b = v & 255;
    return (0.299 * r + 0.587 * g + 0.114 * b) < 140 ? '#fff' : '#111'; }

  function drawLegend(sc){
    legend.textContent = '';
    var add = function(colour, text){ var s = document.createElement('span'), i = document.createElement('i');
      i.style.background = colour; s.appendChild(i); s.appendChild(document.createTextNode(text)); legend.appendChild(s); };
    if (!sc) { Object.keys(KIND).forEach(function(k){ add(KIND[k], k); }); add('#e3eaf5', 'module group'); return; }
    var distinct = sc.vals.filter(function(v, i, a){ return a.indexOf(v) === i; }).sort(function(a, b){ return a - b; });
    var title = document.createElement('b'); title.textContent = sc.o.title + (sc.o.unit ? ' (' + sc.o.unit + ')' : '') + ': ';
    legend.appendChild(title);
    if (distinct.length <= 8) distinct.forEach(function(v){ add(sc.colour(v), fmt(v)); });
    else { var lo = document.createElement('span'); lo.textContent = fmt(sc.inv(sc.lo)) + ' ';
      var ramp = document.createElement('span'); ramp.className = 'fxg-ramp';
      ramp.style.background = 'linear-gradient(to right,' + RAMP.join(',') + ')';
      var hi = document.createElement('span'); hi.textContent = ' ' + fmt(sc.inv(sc.hi)) + (sc.o.log ? ' (log scale)' : '');
      legend.appendChild(lo); legend.appendChild(ramp); legend.appendChild(hi); }
    add('#f2f2f2', 'n/a');
  }

  function render(){
    var t = performance.now();
    geo = {}; abs = {}; measure(data.root); place(data.root, 0, 0);
    while (vp.firstChild) vp.removeChild(vp.firstChild);
    var sc = scale(select.value), frames = el('g', {}, vp), lines = el('g', {'class': 'fxg-edges'}, vp), boxes = el('g', {}, vp);
    Object.keys(abs).forEach(function(id){
      var it = items[id], a = abs[id]; if (!it) return;
      if (isOpen(id)) {
        var f = el('g', {'class': 'fxg-frame', 'data-id': id}, frames);
        if (matches[id]) f.classList.add('fxg-match');
        el('rect', {x: a.x, y: a.y, width: a.w, height: a.h, rx: 8, fill: 'rgba(227,234,245,0.35)', stroke: '#8aa4c8'}, f);
        var head = el('rect', {'class': 'fxg-head', x: a.x, y: a.y, width: a.w, height: HEAD, rx: 8, fill: '#e3eaf5'}, f);
        head.addEventListener('click', function(){ if (id !== data.root) { open[id] = false; render(); } });
        el('text', {x: a.x + 8, y: a.y + 15, 'font-weight': 'bold'}, f).textContent =
          (id === data.root ? '' : '\u25be ') + it.label + (it.info.module ? '  \u00b7 ' + it.info.module : '');
        (it.layout.routes || []).forEach(function(r){ edge(lines, r, id); });
        return;
      }
      var g = el('g', {'class': 'fxg-box ' + (it.kind === 'group' ? 'fxg-group' : 'fxg-node'), 'data-id': id}, boxes);
      if (matches[id]) g.classList.add('fxg-match');
      var v = sc ? it.values[select.value] : undefined;
      var fill = sc ? sc.colour(v) : (it.kind === 'group' ? '#e3eaf5' : (KIND[it.info.kind] || '#fff'));
      el('rect', {x: a.x, y: a.y, width: a.w, height: a.h, rx: it.kind === 'group' ? 6 : 3, fill: fill,
                  stroke: it.kind === 'group' ? '#4a6fa5' : '#777', 'stroke-width': it.kind === 'group' ? 1.6 : 1}, g);
      var name = el('text', {x: a.x + 6, y: a.y + 14, fill: ink(fill), 'font-weight': it.kind === 'group' ? 'bold' : 'normal'}, g);
      name.textContent = (it.kind === 'group' ? '\u25b8 ' : '') + clip(it.label, 24);
      var sub = it.kind === 'group' ? (it.info.module || '') + ' \u00b7 ' + it.info.nodes + ' nodes' : it.info.op;
      if (sc) sub = (select.value === 'bits' && it.info.precision ? it.info.precision : fmt(v) + ' ' + sc.o.unit);
      el('text', {x: a.x + 6, y: a.y + (it.kind === 'group' ? 31 : 28), fill: ink(fill), 'font-size': 10}, g).textContent = clip(sub, 30);
      var tip = el('title', {}, g); tip.textContent = it.path + (it.info.node ? ' :: ' + it.info.node : '');
      g.addEventListener('click', function(){ if (moved) return;
        if (it.kind === 'group') { open[id] = true; render(); } else show(id); });
    });
    drawLegend(sc);
    root.setAttribute('data-boxes', boxes.childNodes.length);
    root.setAttribute('data-render-ms', (performance.now() - t).toFixed(1));
  }
  function edge(parent, r, gid){
    var pts = [r[0]].concat(r[2].map(function(d){ return gid + ' ' + d; })).concat([r[1]]).map(function(k){ return abs[k]; });
    if (pts.some(function(p){ return !p; })) return;
    var p0 = pts[0], d = 'M' + (p0.x + p0.w / 2) + ',' + (p0.y + p0.h);
    for (var i = 1; i < pts.length; i++) {
      var a = pts[i - 1], b = pts[i], ax = a.x + a.w / 2, ay = a.y + a.h, bx = b.x + b.w / 2, by = b.y, my = (ay + by) / 2;
      d += ' C' + ax + ',' + my + ' ' + bx + ',' + my + ' ' + bx + ',' + by;
    }
    el('path', {d: d, fill: 'none', stroke: '#9a9a9a', 'stroke-width': 1.2, 'marker-end': 'url(#' + root.id + '-arrow)'}, parent);
  }
  function show(id){ var it = items[id], lines = [it.label + '  (' + it.path + ')'];
    for (var k in it.info) lines.push(k + ': ' + it.info[k]);
    for (var v in it.values) if (overlays[v]) lines.push(overlays[v].title + ': ' + fmt(it.values[v]) + ' ' + overlays[v].unit);
    detail.textContent = lines.join('\n'); }

  function apply(){ vp.setAttribute('transform', 'translate(' + view.x + ',' + view.y + ') scale(' + view.k + ')'); }
  function fit(){ var a = abs[data.root], w = svg.clientWidth || 1000;
    view.k = Math.min(1, w / (a.w + 20)); view.x = 10; view.y = 10; apply(); }
  var moved = false, drag = null;
  svg.addEventListener('wheel', function(e){ e.preventDefault(); var r = svg.getBoundingClientRect();
    var px = e.clientX - r.left, py = e.clientY - r.top, k = Math.max(0.05, Math.min(4, view.k * Math.exp(-e.deltaY * 0.0015)));
    view.x = px - (px - view.x) * k / view.k; view.y = py - (py - view.y) * k / view.k; view.k = k; apply(); }, {passive: false});
  svg.addEventListener('mousedown', function(e){ drag = {x: e.clientX, y: e.clientY, vx: view.x, vy: view.y}; moved = false; });
  window.addEventListener('mousemove', function(e){ if (!drag) return;
    var dx = e.clientX - drag.x, dy = e.clientY - drag.y; if (Math.abs(dx) + Math.abs(dy) > 3) moved = true;
    view.x = drag.vx + dx; view.y = drag.vy + dy; apply(); });
  window.addEventListener('mouseup', function(){ drag = null; setTimeout(function(){ moved = false; }, 0); });

  function doSearch(){
    var q = search.value.trim().toLowerCase(); matches = {}; var n = 0, first = null;
    if (q) Object.keys(items).forEach(function(id){ var it = items[id];
      if (id === data.root) return;
      if ((it.label + ' ' + it.path + ' ' + (it.info.node || '')).toLowerCase().indexOf(q) < 0) return;
      matches[id] = true; n++; first = first || id;
      for (var p = it.parent; p; p = items[p].parent) open[p] = true; });
    found.textContent = q ? n + ' found' : ''; render();
    if (first && abs[first]) { var a = abs[first]; view.x = 40 - a.x * view.k; view.y = 40 - a.y * view.k; apply(); }
  }
  search.addEventListener('input', doSearch);
  select.addEventListener('change', render);
  root.querySelectorAll('button[data-act]').forEach(function(b){ b.addEventListener('click', function(){
    var act = b.getAttribute('data-act');
    if (act === 'expand') Object.keys(items).forEach(function(id){ if (items[id].kind === 'group') open[id] = true; });
    if (act === 'collapse') { open = {}; open[data.root] = true; data.expanded.forEach(function(id){ open[id] = true; }); }
    render(); fit(); }); });
  var defs = el('defs', {}, svg), m = el('marker', {id: root.id + '-arrow', viewBox: '0 0 10 10', refX: 9, refY: 5,
    markerWidth: 6, markerHeight: 6, orient: 'auto-start-reverse'}, defs);
  el('path', {d: 'M0,0 L10,5 L0,10 z', fill: '#9a9a9a'}, m);
  render(); fit();
  root.setAttribute('data-first-render-ms', (performance.now() - t0).toFixed(1));
  root.setAttribute('data-ready-at-ms', performance.now().toFixed(1));
  root.setAttribute('data-ready', '1');
};
"""
