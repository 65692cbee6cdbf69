;;;; The Lisp benchmark servers.  bench/run starts each in its own process
;;;; with SERVE; every one answers GET /yo with 200 text/plain "Hey!", the
;;;; benchmark's files under /static/ as it serves files by itself, and
;;;; GET /bench-stats with counters the driver reads around a measurement,
;;;; GET /gc after a full garbage collection;
;;;; Hunchentoot's and ours answer GET /megabytes?n=N with N MiB of octets,
;;;; POST /body-length with the length of the body they read, GET
;;;; /test/bytes?kb=N with N KiB of a known pattern, POST /test/digest with
;;;; the SHA-1 of the body they read, and GET
;;;; /bench-code-map with where each compiled function lies (CODE-MAP), and
;;;; ours GET /pool-stats with TASKMASTER-STATISTICS.

(defpackage #:hunchentoot-recycling-taskmaster-bench
  (:use #:cl)
  (:local-nicknames (#:ht #:hunchentoot) (#:hrt #:hunchentoot-recycling-taskmaster)
                    (#:ws #:hunchentoot-recycling-websocket))
  (:export #:serve #:run-benchmarks #:run-comparison #:run-connection-load #:run-slow-readers-load #:run-slow-bodies-load
           #:run-tls-handshakes-load
           #:run-profile #:run-perf-profile #:run-scale #:run-chunked-body-cost #:run-sessions #:run-applications #:run-https
           #:run-websockets))

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defconstant +request-stripes+ 16
  "How many stripes /yo requests are counted in (COUNT-REQUEST).")

(defconstant +words-per-stripe+ 8
  "The words from one stripe to the next: a 64-octet cache line.")

(defstruct (counters (:conc-name counter-))
  ;; Requests to /yo, counted in stripes (COUNT-REQUEST).
  (request-stripes (make-array (* +request-stripes+ +words-per-stripe+) :element-type 'sb-ext:word
                                                                          :initial-element 0)
   :type (simple-array sb-ext:word (*)) :read-only t))

(defvar *counters* (make-counters))

(defun count-request ()
  "Count a /yo or /app/counter request in the stripe of the calling
thread, each stripe on a cache line of its own: a word every thread
incremented moved between the processors' caches at every request, 2.6% of
the server's time at a 0 ms handler, and what measures should weigh as
little as it can on what it measures."
  (sb-ext:atomic-incf (aref (counter-request-stripes *counters*)
                            (* +words-per-stripe+
                               (mod (sb-thread:thread-os-tid sb-thread:*current-thread*) +request-stripes+)))))

(defun counter-requests (counters)
  "The requests to /yo and /app/counter COUNTERS have counted."
  (loop for stripe below +request-stripes+
        sum (aref (counter-request-stripes counters) (* +words-per-stripe+ stripe))))

(defvar *handler-delay* nil
  "Seconds each /yo request sleeps, or NIL for a handler that never calls SLEEP.")

(defvar *timer-delay* nil
  "Milliseconds each /yo reply is deferred for, completed by the engine's
timer (ours only, the server :PARALLEL-TIMER), or NIL.")

(defun hey ()
  "The /yo handler body: count the request, sleep if the workload says so
(or leave the reply to the timer: then the handler's value is ignored)."
  (count-request)
  (cond (*timer-delay*
         (let ((reply (hrt:defer-reply)))
           (hrt:call-after *timer-delay* (lambda () (hrt:complete-reply reply :content-type "text/plain" :body "Hey!")))))
        (*handler-delay*
         (sleep *handler-delay*)))
  "Hey!")

(defun stats-text ()
  "requests and bytes consed by the process, on one line.  The driver counts
the process's threads itself, from outside (CALL-COUNTING-THREADS): a
thread here waking a hundred times a second to count them was 0.0016 of
the 3.01 system calls a request the summary printed."
  (format nil "requests ~D consed ~D~%" (counter-requests *counters*) (sb-ext:get-bytes-consed)))

;;; Hunchentoot and ours: the same handlers, only the acceptor class differs.

(ht:define-easy-handler (yo :uri "/yo") ()
  (setf (ht:content-type*) "text/plain")
  (hey))

(defvar *megabyte-bodies* (make-array 65 :initial-element nil)
  "The body of GET /megabytes?n=N for each N made so far: one vector shared
by every reply, as a handler returning a cached page shares it.")

(defvar *megabyte-bodies-lock* (bt:make-lock "megabyte bodies"))

(defun megabyte-body (count)
  (bt:with-lock-held (*megabyte-bodies-lock*)
    (or (aref *megabyte-bodies* count)
        (setf (aref *megabyte-bodies* count)
              (let ((octets (make-array (* count 1024 1024) :element-type '(unsigned-byte 8))))
                (dotimes (index (length octets) octets)
                  (setf (aref octets index) (mod index 251))))))))

(defun lorem-page (kib)
  "KIB KiB of HTML, the same at every call: numbered lines of lorem ipsum."
  (with-output-to-string (out)
    (loop for line from 0 below (* kib 16)
          do (format out "<p>~4,'0D Lorem ipsum dolor sit amet, consectetur adipiscing elit.</p>~%" line))))

(defvar *lorem-page* (lorem-page 10)
  "The 10 KiB page of /lorem and of nginx's lorem.html.")

(ht:define-easy-handler (lorem :uri "/lorem") ()
  (setf (ht:content-type*) "text/html")
  *lorem-page*)

(ht:define-easy-handler (megabytes :uri "/megabytes") ((n :parameter-type 'integer :init-form 1))
  (setf (ht:content-type*) "application/octet-stream")
  (megabyte-body (max 1 (min 64 n))))

(ht:define-easy-handler (body-length :uri "/body-length") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (length (ht:raw-post-data :force-binary t))))

;;; Every octet in, every octet out, for bench/http2.lisp's checks: the
;;; names are those test/http2-client.py asks for.

(ht:define-easy-handler (bytes :uri "/test/bytes") ((kb :parameter-type 'integer :init-form 1))
  (setf (ht:content-type*) "application/octet-stream")
  (let ((octets (make-array (* 1024 (max 1 (min 65536 kb))) :element-type '(unsigned-byte 8))))
    (dotimes (i (length octets) octets)
      (setf (aref octets i) (mod i 251)))))

(ht:define-easy-handler (digest :uri "/test/digest") ()
  (setf (ht:content-type*) "text/plain")
  (ironclad:byte-array-to-hex-string
   (ironclad:digest-sequence :sha1 (or (ht:raw-post-data :force-binary t)
                                       (make-array 0 :element-type '(unsigned-byte 8))))))

;;; Replies that wait (ours only): the demo's, for bench/events.lisp.

(ht:define-easy-handler (bench-wait :uri "/wait") ((ms :parameter-type 'integer :init-form 1000))
  (let ((reply (hrt:defer-reply :timeout 60)))
    (hrt:call-after ms (lambda () (hrt:complete-reply reply :content-type "text/plain" :body "waited")))
    nil))

(ht:define-easy-handler (bench-events :uri "/events") ((channel :init-form "load"))
  (let ((stream (hrt:start-event-stream)))
    (hrt:send-event stream (princ-to-string (sb-posix:getpid)) :event "hello")
    (hrt:subscribe channel stream)
    nil))

(ht:define-easy-handler (bench-publish :uri "/publish") ((channel :init-form "load") (msg :init-form "")
                                                         (repeat :parameter-type 'integer :init-form 1))
  (setf (ht:content-type*) "text/plain")
  (format nil "~D ~D" (loop repeat repeat sum (hrt:publish channel msg)) (sb-posix:getpid)))

(ht:define-easy-handler (full-gc :uri "/gc") ()
  (setf (ht:content-type*) "text/plain")
  (sb-ext:gc :full t)
  "done")

(ht:define-easy-handler (bench-stats :uri "/bench-stats") ()
  (setf (ht:content-type*) "text/plain")
  (stats-text))

(defun code-map ()
  "Where each compiled function of this process starts, its length in
octets and its name, one line each (hex, hex, the name on one line): what
perf's samples of this process are named by (bench/perf-profile.lisp).
Code compiled at run time (PCL's dispatch functions, the request
constructors) is in it too, hence asked of the running server."
  (let ((entries '()))
    (sb-sys:without-gcing
      (sb-vm::map-allocated-objects
       (lambda (code type size)
         (when (= type sb-vm:code-header-widetag)
           (let ((end (+ (logandc2 (sb-kernel:get-lisp-obj-address code) sb-vm:lowtag-mask) size)))
             (loop for (function next) on (loop for index below (sb-kernel:code-n-entries code)
                                                collect (sb-kernel:%code-entry-point code index))
                   for start = (sb-sys:sap-int (sb-vm::simple-fun-entry-sap function))
                   do (push (list start
                                  (- (if next (sb-sys:sap-int (sb-vm::simple-fun-entry-sap next)) end) start)
                                  (sb-kernel:%simple-fun-name function))
                            entries)))))
       :all))
    (with-output-to-string (out)
      (let ((*print-pretty* nil))
        (loop for (start length name) in entries
              do (format out "~X ~X ~A~%" start length
                         (substitute #\Space #\Newline (prin1-to-string name))))))))

(ht:define-easy-handler (bench-code-map :uri "/bench-code-map") ()
  (setf (ht:content-type*) "text/plain")
  (code-map))

(defvar *acceptor* nil "The Hunchentoot acceptor this process serves with, if any.")

(ht:define-easy-handler (pool-stats :uri "/pool-stats") ()
  (setf (ht:content-type*) "text/plain")
  (let ((*print-readably* nil))
    (prin1-to-string (and (typep *acceptor* 'hrt:parallel-acceptor)
                          (hrt:taskmaster-statistics *acceptor*)))))

(defun start-hunchentoot (port class &rest initargs)
  "Start an acceptor of CLASS on 127.0.0.1:PORT, with its access log off
unless INITARGS say where."
  (setf *acceptor* (ht:start (apply #'make-instance class :address "127.0.0.1" :port port
                                    (append initargs (list :access-log-destination nil))))))

(defclass hunchentoot-logged-easy-acceptor (hrt:parallel-easy-acceptor) ()
  (:documentation "Ours, with an ACCEPTOR-LOG-ACCESS method of its own, as an
application that logs differently has: the entry is then Hunchentoot's
method's, as it was for every acceptor before the engine wrote it."))

(defmethod ht:acceptor-log-access :around ((acceptor hunchentoot-logged-easy-acceptor) &key return-code)
  (declare (ignore return-code))
  (call-next-method))

;;; Portable AllegroServe.

(defun start-aserve (port)
  (flet ((publish-text (path function)
           (net.aserve:publish
            :path path :content-type "text/plain"
            :function (lambda (request entity)
                        (let ((text (funcall function request)))
                          ;; A known length spares AllegroServe chunked output.
                          (setf (net.aserve:request-reply-content-length request) (length text))
                          (net.aserve:with-http-response (request entity)
                            (net.aserve:with-http-body (request entity)
                              (write-string text net.html.generator:*html-stream*))))))))
    (publish-text "/yo" (lambda (request) (declare (ignore request)) (hey)))
    (publish-text "/bench-stats" (lambda (request) (declare (ignore request)) (stats-text))))
  ;; AllegroServe exports no switch for its access log; every server here
  ;; runs with access logs off.
  (setf net.aserve::*enable-logging* nil)
  ;; Its default of 5 worker threads pauses a second whenever all are busy;
  ;; 100 is the thread budget Hunchentoot's default taskmaster has.
  (net.aserve:start :host "127.0.0.1" :port port :listeners 100))

(defun start-server (kind port &key reuse-port worker-scheduling-policy compression http2 access-log
                                   hunchentoots-access-log)
  (ecase kind
    (:hunchentoot (start-hunchentoot port 'ht:easy-acceptor))
    ((:parallel :parallel-timer)
     (apply #'start-hunchentoot port (if hunchentoots-access-log
                                         'hunchentoot-logged-easy-acceptor
                                         'hrt:parallel-easy-acceptor)
            :reuse-port reuse-port :compression compression
            :http2 http2 :access-log-destination access-log
            (and worker-scheduling-policy
                 (list :taskmaster (make-instance 'hrt:recycling-taskmaster
                                                  :worker-scheduling-policy worker-scheduling-policy)))))
    (:aserve (start-aserve port))))

(defun serve-static-folder (kind folder)
  "Serve FOLDER under /static/ the way server KIND does by itself:
Hunchentoot's folder dispatcher, ours, or AllegroServe's directory."
  (ecase kind
    (:hunchentoot (push (ht:create-folder-dispatcher-and-handler "/static/" (pathname folder))
                        ht:*dispatch-table*))
    ((:parallel :parallel-timer)
     (push (hrt:create-static-folder-dispatcher-and-handler "/static/" (pathname folder))
           ht:*dispatch-table*))
    (:aserve (net.aserve:publish-directory :prefix "/static/" :destination folder))))

(defun serve (kind port &key (delay-ms 0) reuse-port worker-scheduling-policy static-folder
                             ssl-port ssl-certificate ssl-key ssl-certificates compression http2
                             access-log hunchentoots-access-log)
  "Start the server KIND on 127.0.0.1:PORT (with SO_REUSEPORT when
REUSE-PORT, and the taskmaster's WORKER-SCHEDULING-POLICY and the
acceptor's COMPRESSION and HTTP2 when given, ours only; its access log to
the file ACCESS-LOG, written by Hunchentoot's method when
HUNCHENTOOTS-ACCESS-LOG), serving STATIC-FOLDER under /static/ when given,
and serve until killed.  With SSL-PORT, the server (ours or Hunchentoot's)
also serves TLS there with the SSL-CERTIFICATE and SSL-KEY files (and
ours SSL-CERTIFICATES by host name, HTTP2, COMPRESSION and ACCESS-LOG as the
plain port), and /pool-stats describes that acceptor."
  (if (eq kind :parallel-timer)
      (setf *timer-delay* (and (plusp delay-ms) delay-ms))
      (setf *handler-delay* (and (plusp delay-ms) (/ delay-ms 1000))))
  (when static-folder
    (serve-static-folder kind static-folder))
  (when (and (member kind '(:parallel :parallel-timer)) (plusp (length (or (uiop:getenv "PGDATABASE") ""))))
    (setf hrt:*channel-bus* (hrt:make-postgresql-channel-bus)))
  (start-server kind port :reuse-port reuse-port :worker-scheduling-policy worker-scheduling-policy
                          :compression compression :http2 http2 :access-log access-log
                          :hunchentoots-access-log hunchentoots-access-log)
  (when ssl-port
    (apply #'start-hunchentoot ssl-port (if (eq kind :hunchentoot) 'ht:easy-ssl-acceptor 'hrt:parallel-easy-ssl-acceptor)
           :ssl-certificate-file ssl-certificate :ssl-privatekey-file ssl-key
           (append (and ssl-certificates (list :ssl-certificates ssl-certificates))
                   (and http2 (list :http2 t))
                   (and (not (eq kind :hunchentoot))
                        (append (and compression (list :compression compression))
                                (and access-log (list :access-log-destination access-log)))))))
  (loop (sleep 3600)))
