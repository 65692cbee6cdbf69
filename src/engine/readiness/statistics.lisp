;;;; The readiness engine's part of TASKMASTER-STATISTICS.

(in-package #:hunchentoot-recycling-taskmaster)

(defun readiness-statistics (set counters)
  "The readiness engine's part of TASKMASTER-STATISTICS: what SET (NIL when
none runs) holds now, and what COUNTERS counted ever."
  (flet ((budget-value (reader)
           (if set (funcall reader (readiness-set-memory-budget set)) 0)))
    (list* :parked-connections (if set (parked-connection-count set) 0)
           :open-connections (if set (readiness-set-connection-count set) 0)
           :unsent-replies (if set (readiness-set-outgoing-count set) 0)
           :arriving-bodies (if set (readiness-set-arriving-body-count set) 0)
           :tls-handshakes (if set (readiness-set-handshake-count set) 0)
           :open-websockets (if set (readiness-set-websocket-count set) 0)
           :websocket-messages-received (connection-counters-websocket-messages-in counters)
           :websocket-messages-sent (connection-counters-websocket-messages-out counters)
           :websocket-octets-received (connection-counters-websocket-octets-in counters)
           :websocket-octets-sent (connection-counters-websocket-octets-out counters)
           :websocket-closes (loop for code across *websocket-close-codes*
                                   for count across (connection-counters-websocket-closes counters)
                                   collect (cons code count) into closes
                                   finally (return (append closes
                                                           (list (cons 0 (aref (connection-counters-websocket-closes counters)
                                                                               (length *websocket-close-codes*)))))))
           :deferred-replies (if set (readiness-set-deferred-count set) 0)
           :deferred-reply-timeouts (connection-counters-deferred-timeouts counters)
           :deferred-clients-gone (connection-counters-deferred-clients-gone counters)
           :pending-timers (if set (pending-timer-count (readiness-set-timers set)) 0)
           :open-event-streams (if set (readiness-set-event-stream-count set) 0)
           :events-sent (connection-counters-events-sent counters)
           :event-streams-not-reading (connection-counters-event-streams-not-reading counters)
           (append (bus-statistics *channel-bus*)
                   (list* :memory-budget-bytes (budget-value #'memory-budget-limit)
           :memory-held-bytes (budget-value #'memory-budget-used)
           :memory-peak-bytes (budget-value #'memory-budget-peak)
           :memory-refusals (budget-value #'memory-budget-refusals)
           :memory-relief-closes (budget-value #'memory-budget-relief-closes)
           :connections-accepted (connection-counters-accepted counters)
           :keep-alive-timeouts (connection-counters-keep-alive-timeouts counters)
           :write-timeouts (connection-counters-write-timeouts counters)
           :body-timeout-replies (connection-counters-body-timeouts counters)
           :handshake-timeouts (connection-counters-handshake-timeouts counters)
           :reply-batches-sent-in-place (connection-counters-batches-sent-in-place counters)
           :open-http2-connections (if set (readiness-set-http2-count set) 0)
           :http2-connections (connection-counters-http2-connections counters)
           :http2-streams (connection-counters-http2-streams counters)
           :http2-streams-reset (connection-counters-http2-streams-reset counters)
           :http2-streams-refused (connection-counters-http2-streams-refused counters)
           :http2-goaways-by-cause (map 'list (lambda (cause count) (cons (string-downcase cause) count))
                                        *http2-goaway-causes* (connection-counters-http2-goaways counters))
           :tls-handshakes-by-protocol (map 'list #'cons *counted-application-protocols*
                                            (connection-counters-tls-handshakes counters))
           :replies-by-class (loop for class from 1 to 5
                                   collect (cons class (request-count counters :replies class)))
           :request-duration-buckets (loop for bound across *duration-bucket-seconds*
                                           for bucket from 0
                                           sum (request-count counters :durations bucket) into cumulative
                                           collect (cons bound cumulative))
           :request-duration-count (loop for bucket to (length *duration-bucket-seconds*)
                                         sum (request-count counters :durations bucket))
           :request-duration-seconds (/ (request-count counters :microseconds) 1000000)
           (loop for (status) in *head-refusals*
                 for count across (connection-counters-refused-heads counters)
                 collect (refusal-statistics-key status)
                 collect count))))))
