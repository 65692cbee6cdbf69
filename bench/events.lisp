;;;; bench/run events: replies that wait, against ours in a process of its
;;;; own -- event streams by the thousand and a publish reaching them,
;;;; deferred replies by the thousand completed by the timer, a subscriber
;;;; that reads nothing, and two processes on one port sharing a throwaway
;;;; PostgreSQL, whose database is stopped for a while under publishing.
;;;; Exit status 0 when every check passes.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defstruct (event-client (:conc-name ec-))
  socket
  (fd -1)
  ;; :HEAD until the reply's head has come, then :OPEN; :CLOSED.
  (state :head)
  (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
  (fill 0)
  ;; The data of each event received, newest first, and the PID of the
  ;; process that serves it (its first event's), or the status of a reply
  ;; that is not an event stream.
  (events '())
  (pid nil)
  (status nil)
  (last-at 0))

(defstruct (event-load (:conc-name el-))
  (port 0)
  (epoll-fd (hrt::make-epoll-set))
  (clients (make-array 0 :adjustable t :fill-pointer t)))

(defun open-event-client (load path)
  "A client that has sent GET PATH on a new connection, watched in LOAD's
epoll set; NIL when it could not connect."
  (handler-case
      (let* ((socket (usocket:socket-connect "127.0.0.1" (el-port load) :element-type '(unsigned-byte 8) :timeout 5))
             (client (make-event-client :socket socket :fd (hrt::socket-file-descriptor socket))))
        (hrt::epoll-watch (el-epoll-fd load) (ec-fd client) (fill-pointer (el-clients load)))
        (vector-push-extend client (el-clients load))
        (hrt::send-without-waiting (ec-fd client) (octets-of (format nil "GET ~A HTTP/1.1~C~CHost: x~C~C~C~C"
                                                                     path #\Return #\Linefeed #\Return #\Linefeed
                                                                     #\Return #\Linefeed)))
        client)
    (error () nil)))

(defun close-event-client (client)
  (setf (ec-state client) :closed)
  (ignore-errors (usocket:socket-close (ec-socket client))))

(defun take-events (client)
  "Note the whole events at the start of CLIENT's buffer, then move what
is left of it to its start."
  (let ((buffer (ec-buffer client))
        (start 0))
    (loop for end = (search #(10 10) buffer :start2 start :end2 (ec-fill client))
          while end
          do (let* ((text (map 'string #'code-char (subseq buffer start end)))
                    (data (search "data: " text)))
               (when data
                 (let ((value (subseq text (+ data 6) (position #\Newline text :start data))))
                   (if (and (null (ec-pid client)) (search "event: hello" text))
                       (setf (ec-pid client) (parse-integer value :junk-allowed t))
                       (push value (ec-events client)))
                   (setf (ec-last-at client) (precise-milliseconds))))
               (setf start (+ end 2))))
    (replace buffer buffer :start2 start :end2 (ec-fill client))
    (decf (ec-fill client) start)))

(defun read-event-client (client)
  "Take what has arrived on CLIENT: the head, then events; a reply with a
Content-Length (a /wait) is noted whole once its head is in."
  (multiple-value-bind (buffer count) (receive-growing (ec-fd client) (ec-buffer client) (ec-fill client))
    (setf (ec-buffer client) buffer)
    (cond ((eq count :would-block))
          ((or (eq count :error) (eql count 0)) (close-event-client client))
          (t (incf (ec-fill client) count)
             (when (eq (ec-state client) :head)
               (multiple-value-bind (status fill) (take-reply-head (ec-buffer client) (ec-fill client))
                 (when status
                   (setf (ec-status client) status
                         (ec-fill client) fill
                         (ec-state client) :open
                         (ec-last-at client) (precise-milliseconds)))))
             (when (eq (ec-state client) :open)
               (take-events client))))))

(defun serve-event-clients (load seconds &optional mute)
  "For SECONDS, read what arrives for every client of LOAD but MUTE."
  (let ((end (seconds-from-now seconds)))
    (loop for token = (hrt::epoll-wait-one (el-epoll-fd load) 5)
          do (unless (member token '(:timeout :interrupted))
               (let ((client (aref (el-clients load) token)))
                 (when (and client (not (eq client mute)) (not (eq (ec-state client) :closed)))
                   (read-event-client client))))
          until (>= (now) end))))

(defun wait-for-clients (load clients predicate seconds)
  "Serve LOAD until PREDICATE holds for every one of CLIENTS, or SECONDS
pass; the milliseconds it took, or NIL."
  (let ((start (precise-milliseconds))
        (deadline (seconds-from-now seconds)))
    (loop (when (every predicate clients)
            (return (- (precise-milliseconds) start)))
          (when (>= (now) deadline)
            (return nil))
          (serve-event-clients load 0.01))))

(defun open-streams (load count channel &key (per-second 2000))
  "COUNT event streams on CHANNEL, opened at most PER-SECOND a second; those
that began (their hello event in) within 60 s."
  (let ((clients (loop with batch = (max 1 (floor per-second 100))
                       for opened from 0 below count by batch
                       append (prog1 (remove nil (loop repeat (min batch (- count opened))
                                                       collect (open-event-client load (format nil "/events?channel=~A"
                                                                                               channel))))
                                (serve-event-clients load 0.01)))))
    (wait-for-clients load clients #'ec-pid 60)
    (remove-if-not #'ec-pid clients)))

(defun published-in-order-p (messages)
  (lambda (client) (equal (reverse (ec-events client)) messages)))

(defun end-event-load (load)
  (loop for client across (el-clients load)
        when client do (close-event-client client))
  (hrt::close-fd (el-epoll-fd load)))

(defun check (label passed format-control &rest arguments)
  (format t "~&  ~:[FAILED~;ok    ~] ~A: ~?~%" passed label format-control arguments)
  (finish-output)
  passed)

;;; One process.

(defun streams-phase (port pid count seconds-to-reach)
  "COUNT streams; three messages published; true when every check passed."
  (let* ((load (make-event-load :port port))
         (rss-before (server-rss-after-gc port pid)))
    (unwind-protect
         (let* ((clients (open-streams load count "load"))
                (rss (server-rss-after-gc port pid))
                (threads (worker-threads port pid))
                (messages (list "first" "second" "third"))
                (start (precise-milliseconds)))
           (dolist (message messages)
             (http-get port (format nil "/publish?channel=load&msg=~A" message)))
           (let* ((milliseconds (and (wait-for-clients load clients (published-in-order-p messages) seconds-to-reach)
                                     (- (precise-milliseconds) start)))
                  (burst-start (precise-milliseconds))
                  (burst (progn (http-get port "/publish?channel=load&repeat=100&msg=burst")
                                (wait-for-clients load clients (lambda (client) (= 103 (length (ec-events client)))) 30)))
                  (burst-seconds (/ (- (precise-milliseconds) burst-start) 1000)))
             (every #'identity
                    (list (check "streams open" (= (length clients) count) "~D of ~D" (length clients) count)
                          (check "threads" (<= threads 24) "~D workers with ~D streams open" threads count)
                          (check "memory per stream" (< (* 1024 (- rss rss-before)) (* 20 count))
                                 "~,1F KB (~,1F MB in all)" (/ (* 1024 (- rss rss-before)) count) (- rss rss-before))
                          (check "publish reaches every stream, in order" milliseconds
                                 "3 messages, the last read ~:[more than ~D s~;~:*~,1F ms~*~] after the first publish (limit ~D s)"
                                 milliseconds seconds-to-reach seconds-to-reach)
                          (check "100 messages at once" burst "every stream had them ~,2F s after the publish: ~:D events a second"
                                 burst-seconds (round (* 100 count) burst-seconds))))))
      (end-event-load load))))

(defun waits-phase (port pid count)
  "COUNT GET /wait?ms=1000 at once; true when all are answered within 3 s on at most 24 threads."
  (let ((load (make-event-load :port port))
        (threads 0))
    (unwind-protect
         (let* ((start (precise-milliseconds))
                (clients (remove nil (loop repeat count collect (open-event-client load "/wait?ms=1000"))))
                (answered (progn
                            (serve-event-clients load 0.5)
                            (setf threads (worker-threads port pid))
                            (wait-for-clients load clients (lambda (client) (eql 200 (ec-status client))) 10)))
                (milliseconds (and answered (- (precise-milliseconds) start))))
           (every #'identity
                  (list (check "deferred replies answered" (and milliseconds (<= milliseconds 3000))
                               "~D of ~D answered 200, ~:[not all within 10 s~;~:*the last ~,1F ms after the first connect~]"
                               (count 200 clients :key #'ec-status) count milliseconds)
                        (check "threads while they wait" (<= threads 24) "~D workers" threads))))
      (end-event-load load))))

(defun mute-stream-phase (port pid)
  "A stream that reads nothing, beside 9 that read, while 5,000 events of
1 KiB are published; true when what the server held for the streams (the
memory budget's count) stayed under 50 MB, its heap after a collection
grew by less, the readers got every event and it kept answering."
  (let ((load (make-event-load :port port)))
    (unwind-protect
         (let* ((clients (open-streams load 10 "mute"))
                (mute (first clients))
                (rss-before (server-rss-after-gc port pid))
                (kilobyte (make-string 1024 :initial-element #\k))
                (peak-held 0))
           (loop for published from 0 below 5000 by 100
                 do (http-get port (format nil "/publish?channel=mute&repeat=100&msg=~A" kilobyte))
                    (serve-event-clients load 0.01 mute)
                    (setf peak-held (max peak-held (or (getf (server-pool-statistics port) :memory-held-bytes) 0))))
           (wait-for-clients load (rest clients) (lambda (client) (= 5000 (length (ec-events client)))) 10)
           (let ((held (/ peak-held 1048576.0))
                 (grown (- (server-rss-after-gc port pid) rss-before))
                 (others (count 5000 (rest clients) :key (lambda (client) (length (ec-events client))))))
             (every #'identity
                    (list (check "a subscriber that reads nothing: held" (<= held 50)
                                 "~,1F MB at the most, for every stream" held)
                          (check "a subscriber that reads nothing: heap" (<= grown 50)
                                 "~,1F MB more after a collection" grown)
                          (check "the others got every event" (= others (length (rest clients)))
                                 "~D of ~D readers" others (length (rest clients)))
                          (check "the server answers" (equal "Hey!" (http-get port "/yo")) "GET /yo")))))
      (end-event-load load))))

;;; Two processes.

(defun cluster-environment (cluster)
  (append (list "REUSE_PORT=1")
          (postgresql-cluster:postgresql-cluster-environment cluster)
          (remove-if (lambda (entry) (eql 0 (search "PG" entry))) (sb-ext:posix-environ))))

(defun launch-bus-server (port core cluster)
  (uiop:launch-program (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
                             "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench:serve :parallel ~D :reuse-port t)"
                                              port))
                       :output "/dev/null" :error-output :output :environment (cluster-environment cluster)))

(defun publish-through (port message)
  "Publish MESSAGE on a new connection to PORT: the PID that published it, or NIL."
  (let ((body (http-get port (format nil "/publish?channel=bus&msg=~A" message))))
    (and body (parse-integer body :start (1+ (or (position #\Space body) -1)) :junk-allowed t))))

(defun processes-phase (port streams)
  "STREAMS streams over two processes, and five messages or more published
through either, until both have published one (at most 40: the kernel picks
the process of each new connection on the shared port, and sent all five of
one run to one): whether the streams are spread over both, whether the
messages reached every one, the clients and their load."
  (let* ((load (make-event-load :port port))
         (clients (open-streams load streams "bus"))
         (pids (remove-duplicates (mapcar #'ec-pid clients)))
         (messages '())
         (publishers '()))
    (loop for i from 0 below 40
          while (or (< i 5) (< (length (remove-duplicates (remove nil publishers))) 2))
          do (let ((message (format nil "m~D" i)))
               (push message messages)
               (push (publish-through port message) publishers)
               (serve-event-clients load 0.05)))
    (setf messages (nreverse messages)
          publishers (nreverse publishers))
    (let ((reached (wait-for-clients load clients
                                     (lambda (client) (subsetp messages (ec-events client) :test #'string=))
                                     5)))
      (list (check "streams over both processes" (and (= (length clients) streams) (= 2 (length pids)))
                   "~D streams on processes ~{~D~^ and ~}" (length clients) pids)
            (check "messages through either reach every stream"
                   (and reached (= 2 (length (remove-duplicates (remove nil publishers)))))
                   "~:[not within 5 s~;~:*the last read ~,1F ms after the last publish~], ~D published by ~{~D~^, ~}"
                   reached (length messages) publishers)
            clients load))))

(defun outage-phase (load clients cluster port outage-seconds)
  "The database stopped OUTAGE-SECONDS while a message is published every
100 ms; true when local delivery went on and delivery across processes
resumed afterwards."
  (postgresql-cluster:stop-postgresql-server cluster)
  (let ((during '()))
    (loop with end = (seconds-from-now outage-seconds)
          for n from 0
          while (< (now) end)
          do (let ((message (format nil "d~D" n)))
               (push (cons message (publish-through port message)) during))
             (serve-event-clients load 0.1))
    (postgresql-cluster:start-postgresql-server cluster)
    (let* ((local (every (lambda (entry)
                           (every (lambda (client) (or (not (eql (ec-pid client) (cdr entry)))
                                                       (member (car entry) (ec-events client) :test #'string=)))
                                  clients))
                         during))
           (resumed (loop repeat 100
                          for n from 0
                          for message = (format nil "a~D" n)
                          for publisher = (publish-through port message)
                          thereis (progn (serve-event-clients load 0.2)
                                         (find-if (lambda (client) (and (not (eql (ec-pid client) publisher))
                                                                        (member message (ec-events client) :test #'string=)))
                                                  clients)))))
      (every #'identity
             (list (check "local delivery during the outage" local "~D messages" (length during))
                   (check "delivery across processes resumes" resumed "after the database came back"))))))

(defun run-events (&key (streams 3000) (many 10000) (waits 2000) core)
  "The loads of the header against ours; true when every check passed."
  (format t "~&bench/run events: ~D streams, then ~D; ~D deferred replies; a subscriber that reads nothing; ~
             two processes sharing PostgreSQL~%" streams many waits)
  (let ((results '()))
    ;; Each phase on a server of its own: a phase's close of thousands of
    ;; connections at once makes work its pool may grow for.
    (dolist (phase (list (lambda (port pid) (streams-phase port pid streams 5))
                         (lambda (port pid) (streams-phase port pid many 1))
                         (lambda (port pid) (waits-phase port pid waits))
                         #'mute-stream-phase))
      (let* ((port (free-port))
             (process (launch-server '(:lisp :parallel) port 0 core "/dev/null")))
        (unwind-protect
             (progn (unless (wait-until-serving port) (error "ours did not answer GET /yo within 30 s"))
                    (push (funcall phase port (uiop:process-info-pid process)) results))
          (stop-server process))))
    (let ((cluster (postgresql-cluster:start-postgresql-cluster))
          (port (free-port))
          (processes '()))
      (unwind-protect
           (progn
             (setf processes (list (launch-bus-server port core cluster) (launch-bus-server port core cluster)))
             (unless (wait-until-serving port) (error "the two processes did not answer GET /yo within 30 s"))
             (sleep 2)
             (destructuring-bind (spread reached clients load) (processes-phase port 200)
               (unwind-protect
                    (push (and spread reached (outage-phase load clients cluster port 10)) results)
                 (end-event-load load)))
             (push (check "both processes alive" (every #'uiop:process-alive-p processes) "after the outage") results))
        (mapc #'stop-server processes)
        (postgresql-cluster:remove-postgresql-cluster cluster)))
    (every #'identity results)))
