;;;; The PostgreSQL channel bus, between two demo processes on one port
;;;; sharing a throwaway cluster: a publish through either reaches the event
;;;; streams of both, in order; with the database stopped, local delivery
;;;; goes on, and delivery across processes resumes once it is back.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite channel-bus :in all :description "Channels across processes through PostgreSQL.")
(in-suite channel-bus)

(defun open-demo-stream (port channel)
  "A socket whose event stream on CHANNEL of the demo at PORT has begun, and
the PID of the process serving it (the data of its first event); NIL when
it did not begin."
  (let ((socket (connect-to-port port)))
    (send-text socket (crlf-lines (format nil "GET /events?channel=~A HTTP/1.1" channel) "Host: x" ""))
    (let ((hello (and (eql 200 (read-reply-head socket)) (read-event socket))))
      (if (and hello (search "event: hello" hello))
          (values socket (parse-integer hello :start (+ (search "data: " hello) 6) :junk-allowed t))
          (progn (usocket:socket-close socket) nil)))))

(defun publish-through (port channel message)
  "Publish MESSAGE to CHANNEL through the demo at PORT, on a new connection:
the PID of the process that published it, or NIL."
  (let ((body (ignore-errors (drakma:http-request (format nil "http://127.0.0.1:~D/publish?channel=~A&msg=~A"
                                                          port channel message)
                                                  :close t :connection-timeout 10))))
    (and (stringp body)
         (let ((at (search "process " body)))
           (and at (parse-integer body :start (+ at 8) :junk-allowed t))))))

(defun event-data (event)
  "The data of EVENT's first data line, or NIL."
  (let ((at (and event (search "data: " event))))
    (and at (subseq event (+ at 6) (position #\Newline event :start at)))))

(defun read-data-until (socket data timeout)
  "True when SOCKET's stream brings an event whose data is DATA within
TIMEOUT seconds, skipping others (and keep-alive comments)."
  (loop with deadline = (+ (get-internal-real-time) (* timeout internal-time-units-per-second))
        for event = (read-event socket :timeout (max 0.1 (/ (- deadline (get-internal-real-time))
                                                         internal-time-units-per-second)))
        when (equal data (event-data event)) return t
        when (or (null event) (> (get-internal-real-time) deadline)) return nil))

(defmacro with-two-demos ((port cluster) &body body)
  "Run BODY with two demos serving PORT, sharing the throwaway CLUSTER."
  (let ((demos (gensym "DEMOS")) (directory (gensym "DIRECTORY")))
    `(with-postgresql-cluster (,cluster)
       (let* ((,port (free-port))
              (,directory (make-scratch-folder))
              (,demos (list (launch-demo-with-sessions ,port ,cluster (concatenate 'string ,directory "a.log"))
                            (launch-demo-with-sessions ,port ,cluster (concatenate 'string ,directory "b.log")))))
         (unwind-protect
              (progn (is (every #'identity ,demos) "a demo did not start")
                     (when (every #'identity ,demos)
                       ,@body))
           (mapc #'stop-process (remove nil ,demos)))))))

(defun streams-on-both (port channel count)
  "COUNT event streams on CHANNEL at PORT, as (socket . pid); fails the test
unless both processes serve some."
  (let ((streams (loop repeat count
                       collect (multiple-value-bind (socket pid) (open-demo-stream port channel)
                                 (cons socket pid)))))
    (is (every #'car streams) "a stream did not begin")
    (is (= 2 (length (remove-duplicates (mapcar #'cdr streams)))) "the streams are not spread over both processes")
    streams))

(test channel-bus.publish-reaches-the-streams-of-every-process-in-order
  (with-two-demos (port cluster)
    (let ((streams (streams-on-both port "bus" 40))
          (publishers '()))
      ;; At least 5 messages, until both processes have published one: the
      ;; kernel picks the process of each new connection by a hash of its
      ;; port, and 5 alike came once in 16 runs.
      (unwind-protect
           (loop for i from 0 below 40
                 until (and (>= i 5) (= 2 (length (remove-duplicates (remove nil publishers)))))
                 do (let ((message (format nil "m~D" i)))
                      (push (publish-through port "bus" message) publishers)
                      (is (every (lambda (stream) (read-data-until (car stream) message 5)) streams)
                          "~A did not reach every stream within 5 s" message)))
        (mapc (lambda (stream) (when (car stream) (usocket:socket-close (car stream)))) streams))
      (is (= 2 (length (remove-duplicates (remove nil publishers)))) "not both processes published: ~S" publishers))))

(test channel-bus.outage-keeps-local-delivery-and-ends
  (with-two-demos (port cluster)
    (let ((streams (streams-on-both port "outage" 20)))
      (unwind-protect
           (progn
             (postgresql-cluster:stop-postgresql-server cluster)
             (let ((publisher (publish-through port "outage" "during")))
               (is (not (null publisher)) "a publish during the outage was not answered")
               (is (every (lambda (stream) (read-data-until (car stream) "during" 5))
                          (remove publisher streams :key #'cdr :test-not #'eql))
                   "the streams of the publishing process did not receive it"))
             (postgresql-cluster:start-postgresql-server cluster)
             ;; Each process reaches the database again within a few seconds.
             (let ((received-elsewhere
                     (loop repeat 40
                           for n from 0
                           for publisher = (publish-through port "outage" (format nil "after~D" n))
                           for elsewhere = (find publisher streams :key #'cdr :test-not #'eql)
                           thereis (and elsewhere (read-data-until (car elsewhere) (format nil "after~D" n) 0.5)))))
               (is-true received-elsewhere "delivery across processes did not resume")))
        (mapc (lambda (stream) (when (car stream) (usocket:socket-close (car stream)))) streams)))))
