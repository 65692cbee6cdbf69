;;;; The keys of TASKMASTER-STATISTICS, in one place: what each one counts,
;;;; and its name in PROMETHEUS-METRICS.  The pool and the engine make the
;;;; plist under these keys; PROMETHEUS-METRICS, the docstring of
;;;; TASKMASTER-STATISTICS and the table in docs/operations.md are made from
;;;; this list (a test compares them).

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *statistics-keys*
  '((:threads :gauge "threads" "Worker threads in the pool.")
    (:busy-threads :gauge "busy_threads" "Workers not waiting for work.")
    (:accepting-threads :gauge "waiting_threads" "Workers waiting for work.")
    (:resting-threads :gauge "resting_threads"
     "Of the workers waiting for work, those resting off the engine while :MAX-WAITING-THREAD-COUNT others wait on it.")
    (:in-request-threads :gauge "in_request_threads"
     "Workers between a complete request head and its reply.")
    (:peak-threads :gauge "peak_threads" "The most workers the pool has held at once.")
    (:requests-served :counter "requests_served_total" "Requests answered through a handler.")
    (:threads-created :counter "threads_created_total" "Worker threads made.")
    (:threads-retired :counter "threads_retired_total" "Worker threads ended as surplus.")
    (:growth-declined :counter "growth_declined_total"
     "Times the pool was asked to grow while the processors had no idle time, or the garbage collector took a tenth of it, and did not.")
    (:heap-collections :counter "heap_collections_total"
     "Collections of every generation the heap guard made, the heap holding over two fifths of its size and half again what was live (the whole process's).")
    (:parked-connections :gauge "parked_connections"
     "Connections waiting without a thread, for bytes or for room to write.")
    (:open-connections :gauge "open_connections" "Connections parked or being served.")
    (:unsent-replies :gauge "unsent_replies"
     "Connections whose reply the socket has not taken whole, waiting for the client to read.")
    (:arriving-bodies :gauge "arriving_bodies" "Requests whose body the engine is reading, before dispatch.")
    (:tls-handshakes :gauge "tls_handshakes" "Connections whose TLS handshake the engine is taking.")
    (:open-websockets :gauge "open_websockets" "Connections that are open websockets.")
    (:websocket-messages-received :counter "websocket_messages_received_total"
     "Websocket messages received whole.")
    (:websocket-messages-sent :counter "websocket_messages_sent_total"
     "Websocket messages sent (or waiting for the client's socket).")
    (:websocket-octets-received :counter "websocket_octets_received_total"
     "Octets received on websockets, frame heads included.")
    (:websocket-octets-sent :counter "websocket_octets_sent_total"
     "Octets sent on websockets, frame heads included.")
    (:websocket-closes :by-code "websocket_closes_total"
     "Websockets closed, by close code: an alist from the code to its count, 1006 for a client gone without a close frame, 0 for codes not listed.")
    (:deferred-replies :gauge "deferred_replies" "Replies deferred by their handler and not completed yet.")
    (:deferred-reply-timeouts :counter "deferred_reply_timeouts_total" "Deferred replies answered their timeout status.")
    (:deferred-clients-gone :counter "deferred_clients_gone_total" "Deferred replies whose client reset the connection first.")
    (:pending-timers :gauge "pending_timers" "Calls waiting on the engine's timer (CALL-AFTER).")
    (:open-event-streams :gauge "open_event_streams" "Connections that are open event streams.")
    (:events-sent :counter "events_sent_total" "Events sent to event streams (or waiting for the client's socket).")
    (:event-streams-not-reading :counter "event_streams_not_reading_total" "Event streams closed because their client took too little of them.")
    (:bus-messages-out :counter "bus_messages_out_total" "Messages this process published to the channel bus.")
    (:bus-messages-in :counter "bus_messages_in_total" "Messages of other processes received from the channel bus.")
    (:bus-messages-dropped :counter "bus_messages_dropped_total" "Messages not sent to the channel bus: its database unreachable, or too many waiting.")
    (:bus-messages-missed :counter "bus_messages_missed_total" "Messages of other processes never received (numbers skipped in their sequence).")
    (:bus-reconnects :counter "bus_reconnects_total" "Times the channel bus reached its database again after losing it.")
    (:memory-budget-bytes :gauge "memory_budget_bytes"
     "The octets the engine may hold for clients (MEMORY-BUDGET).")
    (:memory-held-bytes :gauge "memory_held_bytes"
     "The octets held now: frames and replies waiting for their clients, partial messages and heads, bodies.")
    (:memory-peak-bytes :gauge "memory_peak_bytes" "The most octets held at once.")
    (:memory-refusals :counter "memory_refusals_total"
     "Buffers, requests (503) and websocket messages (1013) refused for want of budget.")
    (:memory-relief-closes :counter "memory_relief_closes_total"
     "Parked connections closed, those holding the most first, to relieve the budget.")
    (:connections-accepted :counter "connections_accepted_total" "Connections accepted.")
    (:keep-alive-timeouts :counter "keep_alive_timeouts_total"
     "Kept-alive connections closed after KEEP-ALIVE-TIMEOUT idle seconds.")
    (:write-timeouts :counter "write_timeouts_total"
     "Connections closed because their client took none of its reply for the write timeout.")
    (:body-timeout-replies :counter "body_timeout_replies_total"
     "Requests answered 408 because their body stalled for the read timeout.")
    (:handshake-timeouts :counter "handshake_timeouts_total"
     "Connections closed because their TLS handshake was not done within the header timeout.")
    (:reply-batches-sent-in-place :counter "reply_batches_sent_in_place_total"
     "Reply batches sent by another worker, their owner held up in a handler.")
    (:open-http2-connections :gauge "open_http2_connections" "Connections that speak HTTP/2.")
    (:http2-connections :counter "http2_connections_total"
     "Connections that began to speak HTTP/2 (h2 or h2c).")
    (:http2-streams :counter "http2_streams_total" "HTTP/2 streams their clients began.")
    (:http2-streams-reset :counter "http2_streams_reset_total"
     "HTTP/2 streams reset by their client before their reply.")
    (:http2-streams-refused :counter "http2_streams_refused_total"
     "HTTP/2 streams refused: HTTP2-MAX-CONCURRENT-STREAMS of their connection's handlers ran.")
    (:http2-goaways-by-cause :by-cause "http2_goaways_total"
     "HTTP/2 GOAWAYs sent, by cause: an alist from \"stop\", \"idle\" and \"protocol-error\" (a flood) to counts.")
    (:tls-handshakes-by-protocol :by-protocol "tls_handshakes_total"
     "TLS handshakes finished, by the protocol ALPN chose: an alist from \"h2\", \"http/1.1\", \"other\" and \"none\".")
    (:tls-certificates :gauge "tls_certificates" "Certificates the acceptor serves.")
    (:tls-certificate-reloads :counter "tls_certificate_reloads_total"
     "Certificates loaded again because their files changed.")
    (:tls-certificate-reload-failures :counter "tls_certificate_reload_failures_total"
     "Replaced certificate files that did not load, each counted once.")
    (:bad-request-replies (:refused 400) "refused_requests_total"
     "Requests refused 400: a malformed head, an ambiguous body length, a missing or invalid Host, a malformed chunked body.")
    (:header-timeout-replies (:refused 408) "refused_requests_total"
     "Requests answered 408: the head did not arrive within HEADER-TIMEOUT.")
    (:length-required-replies (:refused 411) "refused_requests_total"
     "Requests refused 411: a chunked body to an acceptor without input chunking.")
    (:content-too-large-replies (:refused 413) "refused_requests_total"
     "Requests refused 413: a body over MAX-BODY-BYTES.")
    (:uri-too-long-replies (:refused 414) "refused_requests_total"
     "Requests refused 414: a request line over 8 KiB.")
    (:header-too-large-replies (:refused 431) "refused_requests_total"
     "Requests refused 431: more than 100 header lines, or a header block over MAX-HEADER-BYTES.")
    (:body-not-stored-replies (:refused 500) "refused_requests_total"
     "Requests answered 500: a body the temporary directory would not take.")
    (:not-implemented-replies (:refused 501) "refused_requests_total"
     "Requests refused 501: a transfer coding other than chunked, or a method over 32 octets.")
    (:queue-timeout-replies (:refused 503) "refused_requests_total"
     "Requests answered 503: a complete request waited QUEUE-TIMEOUT for a worker.")
    (:version-not-supported-replies (:refused 505) "refused_requests_total"
     "Requests refused 505: an HTTP version other than 1.x.")
    (:replies-by-class :by-class "replies_total"
     "Replies by status class, refusals included: an alist from 1 to 5 (1xx to 5xx) to their counts.")
    (:request-duration-buckets :histogram-buckets "request_duration_seconds"
     "Requests answered through a handler, by seconds from the complete head to the flushed reply: an alist from each upper bound to the count that took at most that long.")
    (:request-duration-count :histogram-count "request_duration_seconds_count"
     "Requests in the histogram.")
    (:request-duration-seconds :histogram-sum "request_duration_seconds_sum"
     "The sum of their durations, in seconds."))
  "Every key of TASKMASTER-STATISTICS: (KEY KIND PROMETHEUS-NAME DESCRIPTION).
KIND is :GAUGE or :COUNTER for a number; (:REFUSED STATUS) for the count of
requests the engine answered STATUS by itself; :BY-CLASS for the alist of
replies by status class; :BY-CODE for the alist of websocket closes by
close code; :BY-PROTOCOL for the alist of TLS handshakes by protocol; :HISTOGRAM-BUCKETS, :HISTOGRAM-COUNT and
:HISTOGRAM-SUM for the request-duration histogram.  The Prometheus name
follows the metrics' prefix; refusals share one family labelled by
status.")

(defun refusal-statistics-key (status)
  "The key of TASKMASTER-STATISTICS counting the requests the engine
answered STATUS by itself."
  (first (find-if (lambda (entry)
                    (let ((kind (second entry)))
                      (and (consp kind) (eql (second kind) status))))
                  *statistics-keys*)))

(defun statistics-keys-table ()
  "The Markdown table of *STATISTICS-KEYS* that docs/operations.md shows."
  (with-output-to-string (out)
    (format out "| Key | Prometheus | What it counts |~%|---|---|---|~%")
    (loop for (key kind name description) in *statistics-keys*
          do (format out "| `~(~S~)` | `~A~@[~A~]` | ~A |~%"
                     key name (and (consp kind) (format nil "{status=\"~D\"}" (second kind)))
                     description))))
