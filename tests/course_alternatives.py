"""A learner's correct work, written differently from the reference: every task of the course.

``BODIES[task id]`` holds, for each region of the task in the order the regions appear in
the reference (file by file, top to bottom), the code a learner might write there: correct,
but not the reference's lines (other loops, other names, other helpers of the standard
library or MLX). ``correct_workspace(ws)`` starts every day of the course in ``ws`` with
``tiny-llm course start`` and fills each stub with its body, as a learner finishing the
course would; the suite's learner-facing tests and the chapter benchmarks then run on it
(``tests/test_learner_workspace.py``). A test that only the reference's exact text passes
fails there: the tests must accept every correct implementation.

A body is written without the region's indentation; it takes the indentation of the stub it
replaces.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from tiny_llm.course import learner
from tiny_llm.course import workspace as course

BODIES: dict[str, list[str]] = {
    "1.1": [
        """
        if self.left <= 0:
            return False
        self.left = self.left - 1
        return True
        """,
        """
        if self.left < needed:
            return 0  # Day 1: a prompt is prefilled whole or waits
        self.left = self.left - needed
        return needed
        """,
    ],
    "1.2": [
        """
        already = self.slot_of.get(request)
        if already is None:
            self.slot_of[request] = self.free_slots.pop()  # the stack's top slot
        return True
        """,
        """
        if request not in self.slot_of:
            return  # never held a slot, or freed already
        freed = self.slot_of.pop(request)
        self.caches[freed].reset()
        self.free_slots.append(freed)
        """,
    ],
    "1.3": [
        """
        for c in chunks:
            req = c.request
            req.num_computed_tokens = c.start + c.num_tokens
        """,
        """
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
                break
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        """,
    ],
    "1.4": [
        """
        while self.waiting:
            if len(self.running) >= self.max_num_seqs or budget.left <= 0:
                break
            head = self.waiting[0]
            granted = self.try_admit(head, budget)
            if not granted:
                break  # the head waits, and so does everyone behind it
            self.running.append(self.waiting.popleft())
            head.status = RequestStatus.RUNNING
            plan[head] = granted
        """,
        """
        if self.policy == "static":
            return len(self.running) == 0  # a new batch only once the old one is gone
        return True
        """,
    ],
    "1.5": [
        """
        budget = self.new_budget()
        granted: dict = {}
        for req in self.running_order():
            if req not in self.running:
                continue  # preempted while making room for an older request
            want = req.num_uncomputed_tokens
            if want == 1:
                got = 1 if budget.take_decode() else 0
            else:
                got = budget.take_prefill(want)
            if not got:
                continue
            if not self.make_room(req, req.num_computed_tokens + got, granted, budget):
                budget.give_back(got)
                continue
            granted[req] = got
        if self.may_admit():
            self.admit(granted, budget)
        chunks = []
        for req, got in granted.items():
            first = req.num_computed_tokens
            chunks.append(ScheduledChunk(req, first, first + got))
        return chunks
        """,
    ],
    "1.6": [
        """
        step = self.step
        bounds = step.query_start_loc
        pieces = []
        for b, chunk in enumerate(step.chunks):
            rows = slice(bounds[b], bounds[b + 1])
            seq_cache = step.kv.caches[b]
            pieces.append(seq_cache.attend_at(layer, q[rows], k[rows], v[rows], scale,
                                              chunk.start))
        if len(pieces) == 1:
            return pieces[0]
        return mx.concatenate(pieces, axis=0)
        """,
    ],
    "1.7": [
        """
        batches = [output_lens[i : i + max_batch]
                   for i in range(0, len(output_lens), max_batch)]
        total = sum(map(max, batches))  # each batch lasts as long as its longest request
        return BatchingStats(total, max_batch * total - sum(output_lens))
        """,
        """
        free_at = [0] * max_batch  # all zeros: already a heap
        for n in output_lens:
            heapq.heapreplace(free_at, free_at[0] + n)  # the earliest free slot takes it
        total = max(free_at) if output_lens else 0
        return BatchingStats(total, max_batch * total - sum(output_lens))
        """,
    ],
    "2.1": [
        """
        granted = self.left if self.left < needed else needed
        """,
    ],
    "2.2": [
        """
        # sorted() is stable: within each group, admission order is kept.
        return sorted(self.running, key=lambda r: r.num_uncomputed_tokens != 1)
        """,
    ],
    "2.3": [
        """
        if granted > self.max_chunk:
            granted = self.max_chunk
        """,
    ],
    "3.1": [
        """
        return (num_tokens + block_size - 1) // block_size
        """,
    ],
    "3.2": [
        """
        if max_len is None:
            max_len = max(seq_lens) if len(seq_lens) else 0
        tokens = sum(seq_lens)
        held = block_size * sum(blocks_needed(n, block_size) for n in seq_lens)
        reserved = len(seq_lens) * max_len
        return Fragmentation(paged_wasted_slots=held - tokens, paged_total_slots=held,
                             dense_wasted_slots=reserved - tokens, dense_total_slots=reserved)
        """,
    ],
    "3.3": [
        """
        held = self.tables[seq_id]
        wanted = self.lengths[seq_id] + num_tokens
        extra_pages = blocks_needed(wanted, self.block_size) - len(held)
        if extra_pages > len(self.free_blocks):
            return None  # all or nothing: nothing taken yet
        for _ in range(extra_pages):
            held.append(self._take_free_block())
        self.lengths[seq_id] = wanted
        return held
        """,
    ],
    "3.4": [
        """
        table = self.tables[seq_id]
        pages_kept = blocks_needed(num_tokens, self.block_size)
        while len(table) > pages_kept:  # the tail page goes first
            page = self.blocks[table.pop()]
            page.ref_count -= 1
            if not page.ref_count:
                self.free_blocks[page.block_id] = None
        if self.lengths[seq_id] > num_tokens:
            self.lengths[seq_id] = num_tokens
        """,
        """
        if seq_id not in self.tables:
            return
        self.truncate(seq_id, 0)
        self.tables.pop(seq_id)
        self.lengths.pop(seq_id)
        """,
    ],
    "3.5": [
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        full_pages = (len(token_ids) - 1) // size  # the last token is never matched
        found: list[int] = []
        chain = None
        for i in range(full_pages):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            chain = page_hash(chain, tokens)
            page = self.cached.get(chain)
            if page is None or self.blocks[page].token_ids != tokens:
                break  # not cached, or a collision: the prefix ends here
            found.append(page)
        return found
        """,
    ],
    "3.6": [
        """
        out = []
        for pos in range(start, end):
            page, offset = divmod(pos, page_size)
            out.append(table[page] * page_size + offset)
        return out
        """,
    ],
    "3.7": [
        """
        while True:
            if self.kv.allocate(req, num_tokens):
                return True
            newest = self.running[-1]
            self.preempt(newest)
            budget.give_back(plan.pop(newest, 0))
            if newest is req:
                return False
        """,
        """
        del self.running[self.running.index(req)]
        self.kv.free(req)  # its K/V is recomputed when it runs again
        req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        req.num_preemptions += 1  # the request's count ...
        self.num_preemptions += 1  # ... and the scheduler's, which the engine reports
        self.waiting.insert(0, req)  # first in line when room comes back
        """,
    ],
    "4.1": [
        """
        num_rows, n_heads, D = q.shape
        page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
        g = n_heads // n_kv_heads
        # [T, Hkv, G, D]: the G query heads that share a KV head, scaled once.
        queries = q.astype(mx.float32).reshape(num_rows, n_kv_heads, g, D) * scale
        hidden = -1e30  # a finite "no score": the first page always has a visible key
        run_max = mx.full((num_rows, n_kv_heads, g, 1), hidden)
        run_sum = mx.zeros_like(run_max)
        out = mx.zeros((num_rows, n_kv_heads, g, D))
        offsets = mx.arange(page_size)
        row_last = walk.last_pos.reshape(num_rows, 1)
        for col in range(walk.num_columns):
            ids = walk.rows_table[:, col]
            ids = mx.where(ids < 0, 0, ids)  # an unused entry reads page 0, all masked
            seen = (col * page_size + offsets)[None, :] <= row_last  # [T, S]
            keys = k_pages[ids].astype(mx.float32).transpose(0, 2, 3, 1)  # [T, Hkv, D, S]
            vals = v_pages[ids].astype(mx.float32)  # [T, S, Hkv, D]
            vals = mx.where(seen[:, :, None, None], vals, 0.0).transpose(0, 2, 1, 3)
            pair_seen = seen[:, None, None, :]
            logits = mx.where(pair_seen, queries @ keys, hidden)  # [T, Hkv, G, S]
            next_max = mx.maximum(run_max, mx.max(logits, axis=-1, keepdims=True))
            weights = mx.where(pair_seen, mx.exp(logits - next_max), 0.0)
            rescale = mx.exp(run_max - next_max)
            run_sum = run_sum * rescale + mx.sum(weights, axis=-1, keepdims=True)
            out = out * rescale + weights @ vals
            run_max = next_max
        return (out / run_sum).reshape(num_rows, n_heads, D).astype(q.dtype)
        """,
    ],
    "4.2": [
        """
        // All n scores first, so that the rescale below happens once for the page.
        for (int t = 0; t < n; ++t) score[t] = dot(q, k + t * stride, D);
        const float top = n > 0 ? *std::max_element(score, score + n) : -kFloatMax;
        const float m_next = top > *m ? top : *m;
        const float rescale = std::exp(*m - m_next);  // underflows to 0 while *m is -FLT_MAX
        // The scores become the weights p in place.
        float added = 0.0f;
        for (int t = 0; t < n; ++t) {
          score[t] = std::exp(score[t] - m_next);
          added += score[t];
        }
        *l = *l * rescale + added;
        *m = m_next;
        // One column of acc at a time: every key's weighted value in turn.
        for (int d = 0; d < D; ++d) {
          float column = acc[d] * rescale;
          for (int t = 0; t < n; ++t) column = fma(score[t], v[t * stride + d], column);
          acc[d] = column;
        }
        """,
        """
        const int64_t page_elems = static_cast<int64_t>(ps) * slot_stride;
        const int64_t head_offset = static_cast<int64_t>(kv_head) * D;
        // Pages past the one that holds the last key the rows see are never visited.
        const int stop = std::min(j1, (num_keys + ps - 1) / ps);
        for (int j = j0; j < stop; ++j) {
          const int first_key = j * ps;
          const int keys = std::min(ps, num_keys - first_key);
          // Logical page j of the sequence is physical page table[j].
          const T* k_src = k_pages + table[j] * page_elems + head_offset;
          const T* v_src = v_pages + table[j] * page_elems + head_offset;
          if (j + 1 < stop)  // ask for the next page's rows while this one is folded
            prefetch_rows(k_pages, v_pages, table[j + 1] * page_elems + head_offset,
                          std::min(ps, num_keys - first_key - ps), D, slot_stride);
          const float* kf = nullptr;
          const float* vf = nullptr;
          int64_t row_stride = slot_stride;
          if constexpr (std::is_same_v<T, float>) {
            kf = k_src;
            vf = v_src;
          } else {  // half and bfloat pages: the page's rows as float first
            float* k_out = kv_f;
            float* v_out = kv_f + static_cast<int64_t>(ps) * D;
            const auto as_float = [](T x) { return static_cast<float>(x); };
            for (int t = 0; t < keys; ++t) {
              std::transform(k_src + t * slot_stride, k_src + t * slot_stride + D,
                             k_out + t * D, as_float);
              std::transform(v_src + t * slot_stride, v_src + t * slot_stride + D,
                             v_out + t * D, as_float);
            }
            kf = k_out;
            vf = v_out;
            row_stride = D;
          }
          // Row r (position first_pos + r) sees the keys up to itself. From row `whole` on,
          // rows see all `keys` of this page and fold it together; the rows before it (on
          // the diagonal page only) fold their own count of keys.
          const int whole = std::max(0, std::min(rows, first_key + keys - 1 - first_pos));
          for (int r = 0; r < whole; ++r) {
            const int sees = first_pos + r - first_key + 1;
            if (sees > 0)
              fold_pairs(qf + r * G * D, G, kf, vf, row_stride, sees, D, score, score_len,
                         m + r * G, l + r * G, acc + r * G * D);
          }
          if (whole < rows)
            fold_pairs(qf + whole * G * D, (rows - whole) * G, kf, vf, row_stride, keys, D,
                       score, score_len, m + whole * G, l + whole * G, acc + whole * G * D);
        }
        """,
    ],
    "4.3": [
        """
        const int64_t count = rows.shape(0);
        const int64_t row_size = count > 0 ? static_cast<int64_t>(rows.nbytes()) / count : 0;
        const int32_t* slot_ids = slots.data<int32_t>();
        const char* from = rows.data<char>();
        char* to = out.data<char>();
        enc.dispatch([from, to, slot_ids, count, row_size]() {
          for (int64_t i = 0; i < count; ++i) {
            // Row i goes to flat slot slot_ids[i] of the pool: page * page_size + offset.
            std::copy_n(from + i * row_size, row_size, to + slot_ids[i] * row_size);
          }
        });
        """,
    ],
    "4.4": [
        """
        const long head_offset = long(kv_head) * HEAD_DIM;
        for (int j = int(sg); j < num_pages; j += kSimdgroups) {
          // Logical page j of the sequence is physical page block_table[b, j]; its first
          // slot, in 64 bits (a layer's pool can hold more than 2^31 elements).
          const long first_slot = long(block_table[b * max_pages + j]) * page_size;
          const int first_key = j * page_size;
          const int end_key = min(num_keys, first_key + page_size);
          for (int key = first_key; key < end_key; ++key) {
            const long row_start = (first_slot + (key - first_key)) * slot_stride + head_offset;
            const device T* k_row = k_pages + row_start;
            const device T* v_row = v_pages + row_start;
            float kk[PER_LANE];
            float vv[PER_LANE];
            for (int i = 0; i < PER_LANE; ++i) {
              const int d = int(lane) + 32 * i;
              if (d < HEAD_DIM) {
                kk[i] = float(k_row[d]);
                vv[i] = float(v_row[d]);
              } else {
                kk[i] = 0.0f;
                vv[i] = 0.0f;
              }
            }
            for (int g = 0; g < GROUP; ++g) {
              float part = 0.0f;
              for (int i = 0; i < PER_LANE; ++i) {
                part = fma(qr[g][i], kk[i], part);
              }
              const float s = simd_sum(part);  // the same in every lane
              if (s > m[g]) {
                // A new maximum: what came before shrinks, this key weighs exp(0) = 1.
                const float shrink = exp(m[g] - s);
                l[g] = l[g] * shrink + 1.0f;
                for (int i = 0; i < PER_LANE; ++i) {
                  acc[g][i] = fma(acc[g][i], shrink, vv[i]);
                }
                m[g] = s;
              } else {
                const float w = exp(s - m[g]);
                l[g] += w;
                for (int i = 0; i < PER_LANE; ++i) {
                  acc[g][i] = fma(w, vv[i], acc[g][i]);
                }
              }
            }
          }
        }
        """,
    ],
    "5.1": [
        """
        singles: list[int] = []
        tiles: list[QueryTile] = []
        bounds = list(query_start_loc)
        for seq, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if hi - lo == 1:
                singles.append(lo)  # a decode keeps the vector schedule
            else:
                tiles += [QueryTile(seq, r, min(hi, r + tile_rows) - r)
                          for r in range(lo, hi, tile_rows)]
        return FlashSchedule(vector_rows=singles, tiles=tiles)
        """,
    ],
    "5.2": [
        """
        ids = walk.tables[:, j]
        ids = mx.where(ids >= 0, ids, 0)  # -1: past the sequence, masked below
        pos = j * page_size + slot_pos
        keys = mx.swapaxes(k_pages[ids].astype(mx.float32), 1, 2)  # [N, Hkv, S, D]
        vals = mx.swapaxes(v_pages[ids].astype(mx.float32), 1, 2)
        # V past the tile's last key may hold garbage (NaN): 0 * NaN would leak.
        vals = mx.where(pos.reshape(1, 1, -1, 1) <= tile_limit.reshape(-1, 1, 1, 1), vals, 0.0)
        pair_sees = pos.reshape(1, 1, 1, -1) <= limit  # [N, 1, R*G, S]
        s = mx.where(pair_sees, qt @ mx.swapaxes(keys, -1, -2), -mx.inf)
        best = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
        w = mx.exp(s - best)
        shrink = mx.exp(m - best)
        denom = shrink * denom + mx.sum(w, axis=-1, keepdims=True)
        acc = shrink * acc + w @ vals
        m = best
        """,
    ],
    "5.3": [
        """
        for (int b = 0; b < num_seqs; ++b) {
          const int end = qsl[b + 1];
          int first = qsl[b];
          while (first < end) {
            const int count = end - first < tile ? end - first : tile;
            items.push_back(Tile{b, first, count});
            first += count;
          }
        }
        """,
    ],
    "5.4": [
        """
        static_assert(kKeyTile == kSimdgroups, "one simdgroup stages each key of a tile");
        for (int key0 = 0; key0 < num_keys; key0 += kKeyTile) {
          // Stage the tile: simdgroup sg copies key key0 + sg, its lanes across HEAD_DIM.
          // K goes in transposed (k_tile[d * 8 + key]) so that K^T loads as it is; V as
          // rows (v_tile[key * HEAD_DIM + d]). Keys past the last one are zeros.
          {
            const int key = key0 + int(sg);
            const bool live = key < num_keys;
            const long slot = long(block_table[b * max_pages + key0 / page_size]) * page_size +
                key0 % page_size + int(sg);
            const long row_start = slot * slot_stride + long(kv_head) * HEAD_DIM;
            for (int d = int(lane); d < HEAD_DIM; d += kSimdWidth) {
              k_tile[d * kKeyTile + int(sg)] = live ? float(k_pages[row_start + d]) : 0.0f;
              v_tile[int(sg) * HEAD_DIM + d] = live ? float(v_pages[row_start + d]) : 0.0f;
            }
          }
          threadgroup_barrier(mem_flags::mem_threadgroup);

          // S = Q K^T for this simdgroup's 8 pairs against the 8 keys.
          simdgroup_matrix<float, 8, 8> scores = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          for (int c = 0; c < CHUNKS; ++c) {
            simdgroup_matrix<float, 8, 8> k_chunk;  // rows d = 8c .. 8c + 7, columns keys
            simdgroup_load(k_chunk, k_tile + c * 64, 8);
            simdgroup_multiply_accumulate(scores, qm[c], k_chunk, scores);
          }
          simdgroup_store(scores, my_scratch, 8);
          simdgroup_barrier(mem_flags::mem_threadgroup);

          // Lane i < 8 owns pair i: its row of S becomes its row of P, in place.
          float rescale = 1.0f;
          if (lane < kPairsPerSimdgroup) {
            threadgroup float* row_s = my_scratch + int(lane) * kKeyTile;
            const int seen = my_valid ? clamp(my_pos - key0 + 1, 0, int(kKeyTile)) : 0;
            float top = m;
            for (int j = 0; j < seen; ++j) {
              top = max(top, row_s[j]);
            }
            rescale = exp(m - top);
            float added = 0.0f;
            for (int j = 0; j < kKeyTile; ++j) {
              const float w = j < seen ? exp(row_s[j] - top) : 0.0f;
              row_s[j] = w;
              added += w;
            }
            l = l * rescale + added;
            m = top;
          }
          simdgroup_barrier(mem_flags::mem_threadgroup);
          simdgroup_matrix<float, 8, 8> p_tile;
          simdgroup_load(p_tile, my_scratch, 8);
          simdgroup_barrier(mem_flags::mem_threadgroup);
          // The scratch now holds diag(rescale): lane i writes row i.
          if (lane < kPairsPerSimdgroup) {
            for (int j = 0; j < 8; ++j) {
              my_scratch[int(lane) * 8 + j] = j == int(lane) ? rescale : 0.0f;
            }
          }
          simdgroup_barrier(mem_flags::mem_threadgroup);
          simdgroup_matrix<float, 8, 8> shrink;
          simdgroup_load(shrink, my_scratch, 8);
          // O = diag(rescale) O + P V, chunk by chunk of HEAD_DIM.
          for (int c = 0; c < CHUNKS; ++c) {
            simdgroup_matrix<float, 8, 8> v_chunk;
            simdgroup_load(v_chunk, v_tile + c * 8, HEAD_DIM);
            simdgroup_multiply(om[c], shrink, om[c]);
            simdgroup_multiply_accumulate(om[c], p_tile, v_chunk, om[c]);
          }
          // The next tile overwrites k_tile and v_tile: every simdgroup must be done here.
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        """,
    ],
    "6.1": [
        """
        k = len(draft_tokens)
        for i in range(k):
            tok = draft_tokens[i]
            q_tok = draft_probs[i, tok]
            # Keep with probability min(1, p/q): u < p/q is u * q < p (q > 0).
            kept = q_tok > 0 and rng.random() * q_tok < target_probs[i, tok]
            if not kept:
                leftover = np.clip(target_probs[i] - draft_probs[i], 0.0, None)
                return i, _draw(leftover, rng)
        return k, _draw(target_probs[k], rng)
        """,
    ],
    "6.2": [
        """
        pages_committed = tables.cached_pages.get(request, (0, None))[0]
        floor = pages_committed * tables.blocks.block_size
        if num_tokens < floor:
            raise ValueError(f"rewinding to {num_tokens} tokens would cut into the "
                             f"{pages_committed} pages committed to the prefix cache "
                             f"(their {floor} tokens are accepted)")
        tables.blocks.truncate(request, num_tokens)
        """,
    ],
    "6.3": [
        """
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = tokens[total - n :]
            # Scan back from the newest window that still has a token after it.
            hit = next((s for s in range(total - n - 1, -1, -1)
                        if tokens[s : s + n] == tail), None)
            if hit is not None:
                return tokens[hit + n : hit + n + k]
        return []
        """,
    ],
    "6.4": [
        """
        committed = k.shape[0] - len(drafts)
        rows = []
        for i in range(-1, len(drafts)):  # -1: the last token's row
            path = set()
            while i >= 0:
                path.add(committed + i)
                i = drafts.parent(i)
            rows.append([key < committed or key in path for key in range(k.shape[0])])
        return causal_attention(q, k, v, scale, committed - 1, mx.array(np.array(rows)))
        """,
    ],
    "6.5": [
        """
        kept: list[int] = []
        node = -1  # the request's last token
        while True:
            p = target_probs[node + 1].copy()
            for child in (c for c in range(len(drafts)) if drafts.parent(c) == node):
                x, q = drafts.tokens[child], draft_probs[child]
                if q[x] > 0 and rng.random() * q[x] < p[x]:
                    kept.append(child)
                    node = child
                    break
                p = np.clip(p - q, 0.0, None)
                p /= p.sum()
            else:
                return kept, _draw(p, rng)
        """,
    ],
    "7.1": [
        """
        gates = mx.softmax(logits.astype(mx.float32), axis=-1)
        chosen = mx.argsort(-gates, axis=-1)[..., :top_k]  # the k most probable, best first
        chosen_weights = mx.take_along_axis(gates, chosen, axis=-1)
        if normalize:
            chosen_weights = chosen_weights / mx.sum(chosen_weights, axis=-1, keepdims=True)
        return Routing(experts=chosen.astype(mx.int32), weights=chosen_weights)
        """,
    ],
    "7.2": [
        """
        k = experts.shape[-1]
        assignments = experts.flatten()
        by_expert = mx.argsort(assignments)  # assignment a is row a // k's
        return Dispatch(order=by_expert, rows=mx.take(x, by_expert // k, axis=0),
                        expert_ids=mx.take(assignments, by_expert))
        """,
    ],
    "7.3": [
        """
        num_rows, k = weights.shape
        # Gather by the inverse permutation: assignment a's output sits at inverse[a].
        inverse = mx.argsort(order)
        back = mx.take(outputs, inverse, axis=0).reshape(num_rows, k, outputs.shape[-1])
        mixed = mx.einsum("tk,tkd->td", weights.astype(mx.float32), back.astype(mx.float32))
        return mixed.astype(outputs.dtype)
        """,
    ],
    "8.1": [
        """
        if split == "row" and "bias" in layer:
            raise ValueError("cannot shard a layer with a bias by rows: every rank would add it")
        params = layer.parameters()
        axes = {}
        for name, value in params.items():
            along = value.ndim - 1 if split == "row" or name == "bias" else value.ndim - 2
            if value.shape[along] % size != 0:
                raise ValueError(f"{name} has {value.shape[along]} entries along axis {along}, "
                                 f"which {size} ranks cannot share equally")
            axes[name] = along
        for name, along in axes.items():  # every check passed: now slice
            layer[name] = mx.contiguous(mx.split(params[name], size, axis=along)[rank])
        """,
    ],
    "8.2": [
        """
        n = group.size()
        stacked = mx.distributed.all_gather(x, group=group).reshape(n, *x.shape)
        # Rank 0 + rank 1 + ..., always in that order, so every rank gets the same bits.
        return sum((stacked[i] for i in range(1, n)), start=stacked[0])
        """,
    ],
    "8.3": [
        """
        layout = batch.kv
        block_table, context_lens, query_start_loc = layout.page_metadata
        header = dict(
            chunks=[[chunk.start, chunk.end] for chunk in batch.chunks],
            query_start_loc=list(batch.query_start_loc),
            context_lens=list(batch.context_lens),
            decode_rows=batch.decode_rows,
        )
        ordered = (batch.token_ids, batch.positions, layout.slot_mapping, block_table,
                   context_lens, query_start_loc)
        return header, list(map(np.array, ordered))
        """,
    ],
    "9.1": [
        """
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        # Little-endian 32-bit words, so the bytes in order, each least significant bit
        # first, are the tokens in order: token t is bit t of the stream.
        return np.unpackbits(mask, count=self.vocab_size, bitorder="little").view(np.bool_)
        """,
    ],
    "9.2": [
        """
        masked = np.array(row, dtype=np.float32)  # a copy: the caller's row stays as it was
        masked[~constraint.allowed()] = -np.inf
        return masked
        """,
    ],
}


def fill(text: str, path: Path, bodies: dict[str, list[str]]) -> str:
    """``text`` (a stubbed file) with the regions of the tasks in ``bodies`` replaced by their
    bodies, in order; the marks stay, as a learner's file keeps them."""
    found = course.regions_in(text, path)
    nth: dict[str, int] = {}
    order = []
    for region, task_id, _, _ in found:
        if task_id in bodies:
            order.append((region, task_id, nth.get(task_id, 0)))
            nth[task_id] = nth.get(task_id, 0) + 1
    lines = text.splitlines()
    for region, task_id, i in reversed(order):
        stub = lines[region.start + 1 : region.end]
        indent = next((ln[: len(ln) - len(ln.lstrip())] for ln in stub if ln.strip()),
                      region.indent)
        body = textwrap.dedent(bodies[task_id][i]).strip("\n")
        lines[region.start + 1 : region.end] = [indent + ln if ln.strip() else ""
                                                for ln in body.splitlines()]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def correct_workspace(ws: Path, tasks: set[str] | None = None) -> Path:
    """Start every day in ``ws`` and fill the stubs of ``tasks`` (default: all) with their
    bodies; returns ``ws``."""
    previous = os.environ.get(learner.ENV)
    os.environ[learner.ENV] = str(ws)
    try:
        for day in sorted({t.day for t in course.tasks().values()}):
            course.start(day)
    finally:
        if previous is None:
            del os.environ[learner.ENV]
        else:
            os.environ[learner.ENV] = previous
    chosen = {k: v for k, v in BODIES.items() if tasks is None or k in tasks}
    for path in sorted({r.path for t in course.tasks().values() for r in t.regions}):
        target = course.workspace_file(ws, path)
        target.write_text(fill(target.read_text(), path, chosen))
    return ws
