;;;; Random well-formed requests, each sent as it is to Hunchentoot's
;;;; EASY-ACCEPTOR and to ours, over HTTP and over TLS, must be answered
;;;; alike: the same status, headers and body, and the same request as a
;;;; handler sees it.  The requests are drawn from a fixed seed, so that a
;;;; failure names a request that can be sent again.  They avoid what ours
;;;; answers differently on purpose (docs/how-it-works.md): a missing or
;;;; invalid Host, transfer codings in HTTP/1.0, Range headers, targets in
;;;; absolute form, Expect in HTTP/1.0; and the Keep-Alive header, whose
;;;; timeout ours names differently, is not compared.  Requests go one to a
;;;; connection, or pipelined, several written at once.

(in-package #:hunchentoot-recycling-taskmaster-test)

(in-suite http)

(ht:define-easy-handler (test-request-echo :uri "/test/request-echo") ()
  (setf (ht:content-type*) "text/plain; charset=utf-8")
  (let ((*print-pretty* nil))
    (format nil "~S"
            (list (ht:request-method*) (ht:server-protocol*) (ht:request-uri*) (ht:script-name*)
                  (ht:query-string*) (ht:host) (ht:get-parameters*)
                  ;; A file's temporary pathname differs: its name, type and length.
                  (loop for (name . value) in (ht:post-parameters*)
                        collect (cons name (if (consp value)
                                               (list (second value) (third value)
                                                     (with-open-file (in (first value)) (file-length in)))
                                               value)))
                  (ht:cookies-in*) (ht:headers-in*)
                  (let ((body (ht:raw-post-data :force-binary t)))
                    (if (typep body 'sequence) (length body) body))))))

(defparameter *random-request-count* 300
  "The requests, or pipelines of requests, CHECK-RANDOM-REQUESTS sends each server.")

(defun random-element (random-state &rest choices)
  (nth (random (length choices) random-state) choices))

(defun random-query (random-state)
  (format nil "~{~A~^&~}"
          (loop repeat (random 4 random-state)
                collect (format nil "~A=~A"
                                (random-element random-state "a" "b" "name" "x%20y" "a")
                                (random-element random-state "1" "" "two+words" "%C3%BC" "%FC" "a%26b" "%2B")))))

(defun random-body (random-state http-1.1-p files-p)
  "Headers (an alist) and octets of a random request body, or NIL and an
empty body; multipart with a file only when FILES-P."
  (let* ((kind (if files-p
                   (random-element random-state :form :form :text :multipart :none)
                   (random-element random-state :form :form :text :none)))
         (content-type (ecase kind
                         (:form (random-element random-state "application/x-www-form-urlencoded"
                                                "application/x-www-form-urlencoded; charset=utf-8"
                                                "application/x-www-form-urlencoded; charset=iso-8859-1"))
                         (:text (random-element random-state "text/plain" "text/plain; charset=utf-8"))
                         (:multipart "multipart/form-data; boundary=XyZ")
                         (:none nil)))
         (text (ecase kind
                 (:form (random-element random-state "a=1&b=2" "a=%C3%BC" "a=%FC&a=2" "=x&y" "name=two+words"))
                 (:text (format nil "hello, w~Crld" (code-char 246)))
                 (:multipart (crlf-lines "--XyZ" "Content-Disposition: form-data; name=\"a\"" "" "field"
                                         "--XyZ" "Content-Disposition: form-data; name=\"f\"; filename=\"f.txt\""
                                         "Content-Type: text/plain" "" "file contents" "--XyZ--"))
                 (:none nil)))
         (octets (if text (flex:string-to-octets text :external-format :utf-8) #())))
    (if (null text)
        (values nil octets)
        (values (list* (cons "Content-Type" content-type)
                       (if (and http-1.1-p (zerop (random 4 random-state)))
                           (list (cons "Transfer-Encoding" "chunked"))
                           (list (cons "Content-Length" (princ-to-string (length octets))))))
                octets))))

(defun chunked-octets (octets)
  "OCTETS framed as one chunk and the last one."
  (concatenate '(vector (unsigned-byte 8))
               (flex:string-to-octets (format nil "~X~C~C" (length octets) #\Return #\Linefeed))
               octets
               (flex:string-to-octets (crlf-lines "" "0" ""))))

(defun random-request (random-state &key (connection "close"))
  "A random well-formed request asking for the CONNECTION it names, as a
function of the port it is sent to that returns its octets; a description
of it; true when it is a HEAD request."
  (let* ((http-1.1-p (plusp (random 4 random-state)))
         (method (random-element random-state "GET" "GET" "GET" "HEAD" "POST" "POST" "PUT" "DELETE"
                                 "OPTIONS" "PATCH"))
         (path (random-element random-state "/test/request-echo" "/test/request-echo" "/test/request-echo"
                               "/test/params" "/test/body" "/test/get-cookie" "/test/utf-8" "/test/error"
                               "/test/chunked-reply" "/test/nowhere" "/test/set-cookie"))
         (query (random-query random-state))
         (target (if (string= query "") path (format nil "~A?~A" path query)))
         (host (and (or http-1.1-p (zerop (random 2 random-state)))
                    (random-element random-state "127.0.0.1" "127.0.0.1:PORT" "example.org")))
         (extra (remove nil (list (and (zerop (random 3 random-state))
                                       (cons "Cookie" (random-element random-state "flavour=lemon" "a=b; c=d"
                                                                      "flavour=x; flavour=y")))
                                  (and (zerop (random 3 random-state))
                                       (cons "User-Agent" "random-requests/1.0"))
                                  (and (zerop (random 4 random-state))
                                       (cons "X-Note" (random-element random-state "two  spaces" ""
                                                                      (format nil "tab~Cin" #\Tab)
                                                                      (string (code-char 252)))))
                                  (and http-1.1-p (zerop (random 8 random-state))
                                       (cons "Expect" "100-continue"))))))
    (multiple-value-bind (body-headers body)
        (if (member method '("POST" "PUT" "PATCH") :test #'string=)
            ;; Only the echo handler names an uploaded file without its
            ;; temporary pathname, whose number differs.
            (random-body random-state http-1.1-p (string= path "/test/request-echo"))
            (values nil #()))
      (let ((headers (append (and host (list (cons "Host" host))) extra body-headers
                             (list (cons "Connection" connection))))
            (line (format nil "~A ~A HTTP/1.~:[0~;1~]" method target http-1.1-p)))
        (values (lambda (port)
                  (concatenate '(vector (unsigned-byte 8))
                               (flex:string-to-octets
                                (apply #'crlf-lines line
                                       (append (loop for (name . value) in headers
                                                     collect (format nil "~A: ~A" name
                                                                     (cl-ppcre:regex-replace "PORT" value
                                                                                             (princ-to-string port))))
                                               (list "")))
                                :external-format :utf-8)
                               (if (assoc "Transfer-Encoding" headers :test #'string=)
                                   (chunked-octets body)
                                   body)))
                (format nil "~A ~S" line headers)
                (string= method "HEAD"))))))

(defun random-requests (random-state pipelined-p)
  "One random request, or when PIPELINED-P two to four sent together, all
but the last kept alive: as RANDOM-REQUEST, a function of the port that
returns their octets and a description, and a list of whether each is a
HEAD request."
  (let ((requests (loop for count downfrom (if pipelined-p (+ 2 (random 3 random-state)) 1) above 0
                        collect (multiple-value-list
                                 (random-request random-state
                                                 :connection (if (= count 1) "close" "keep-alive"))))))
    (values (lambda (port)
              (apply #'concatenate '(vector (unsigned-byte 8))
                     (mapcar (lambda (request) (funcall (first request) port)) requests)))
            (format nil "~{~A~^~%~}" (mapcar #'second requests))
            (mapcar #'third requests))))

(defun read-to-end (stream)
  "Every octet from STREAM until the server closes the connection."
  (let ((octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
    (loop for byte = (handler-case (read-byte stream nil)
                       ;; A reset, or TLS cut without its closing alert.
                       (error () nil))
          while byte
          do (vector-push-extend byte octets))
    octets))

(defun dechunked (octets start)
  "The body framed in chunks in OCTETS from START, its chunks joined."
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
    (loop
      (let* ((line-end (search #(13 10) octets :start2 start))
             (size (parse-integer (flex:octets-to-string octets :start start :end line-end :external-format :latin-1)
                                  :radix 16 :junk-allowed t)))
        (when (or (null size) (zerop size))
          (return body))
        (loop for index from (+ line-end 2) repeat size
              do (vector-push-extend (aref octets index) body))
        (setf start (+ line-end 2 size 2))))))

(defparameter *answer-headers-compared-not*
  '("date" "server" "keep-alive")
  "Reply headers left out of the comparison: the time, and the keep-alive
timeout ours names differently.")

(defun parsed-answers (octets port head-requests)
  "The responses in OCTETS to requests of which HEAD-REQUESTS tells, in
order, whether each was a HEAD request (its response has no body); each as
(status headers body): headers sorted, named in lowercase, but those of
*ANSWER-HEADERS-COMPARED-NOT*; bodies unchunked, as Latin-1 text, PORT in
them written PORT."
  (let ((start 0) (answers '()))
    (loop while (< start (length octets))
          do (let* ((head-end (or (search #(13 10 13 10) octets :start2 start) (return)))
                    (lines (cl-ppcre:split "\\r\\n" (flex:octets-to-string octets :start start :end head-end
                                                                                   :external-format :latin-1)))
                    (status (parse-integer (first lines) :start 9 :end 12))
                    ;; A 100 Continue comes before its request's response.
                    (head-only-p (and (/= status 100) (pop head-requests)))
                    (headers (loop for line in (rest lines)
                                   for colon = (position #\: line)
                                   collect (cons (string-downcase (subseq line 0 colon))
                                                 (string-trim " " (subseq line (1+ colon))))))
                    (length (cdr (assoc "content-length" headers :test #'string=)))
                    (body-start (+ head-end 4))
                    (body (cond ((or head-only-p (member status '(100 204 304))) #())
                                (length (subseq octets body-start (+ body-start (parse-integer length))))
                                ((equal (cdr (assoc "transfer-encoding" headers :test #'string=)) "chunked")
                                 (dechunked octets body-start))
                                (t (subseq octets body-start)))))
               (push (list status
                           (sort (remove-if (lambda (header) (member (car header) *answer-headers-compared-not*
                                                                     :test #'string=))
                                            headers)
                                 #'string< :key (lambda (header) (format nil "~A ~A" (car header) (cdr header))))
                           (cl-ppcre:regex-replace-all (princ-to-string port)
                                                       (flex:octets-to-string body :external-format :latin-1)
                                                       "PORT"))
                     answers)
               (setf start (cond ((or head-only-p (member status '(100 204 304))) body-start)
                                 (length (+ body-start (parse-integer length)))
                                 (t (length octets))))))
    (nreverse answers)))

(defun answers-to (server requests head-requests)
  "What SERVER answers to REQUESTS (a function of its port returning their
octets; HEAD-REQUESTS as PARSED-ANSWERS takes it) sent together on a
connection of its own, over TLS when SERVER is an SSL acceptor; :TIMEOUT
when it has not closed the connection within 5 s."
  (let* ((port (ht:acceptor-port server))
         (socket (connect-to-port port)))
    (unwind-protect
         (handler-case
             (bt:with-timeout (5)
               (let ((stream (if (ht:acceptor-ssl-p server)
                                 (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)
                                 (usocket:socket-stream socket))))
                 (write-sequence (funcall requests port) stream)
                 (finish-output stream)
                 (parsed-answers (read-to-end stream) port head-requests)))
           (bt:timeout () :timeout))
      (usocket:socket-close socket))))

(defun check-random-requests (their-class our-class &key pipelined-p initargs)
  "Send *RANDOM-REQUEST-COUNT* random requests, or pipelines of them when
PIPELINED-P, to an acceptor of THEIR-CLASS and one of OUR-CLASS, both made
of INITARGS; each must be answered alike."
  (let ((random-state (sb-ext:seed-random-state 20261126))
        (timeouts 0))
    (with-thread-leak-check ()
      (with-server (theirs (apply #'make-server their-class initargs))
        (with-server (ours (apply #'make-server our-class initargs))
          (loop repeat *random-request-count*
                for number from 1
                ;; A server that no longer answers would cost every case
                ;; its timeout: three are enough to fail.
                while (< timeouts 3)
                do (multiple-value-bind (requests description head-requests)
                       (random-requests random-state pipelined-p)
                     (let ((their-answers (answers-to theirs requests head-requests))
                           (our-answers (answers-to ours requests head-requests)))
                       (when (member :timeout (list their-answers our-answers))
                         (incf timeouts))
                       (is (consp their-answers) "case ~D, ~A: ~A answered ~S"
                           number description their-class their-answers)
                       (is (equal their-answers our-answers)
                           "case ~D, ~A:~%~A answers ~S~%~A answers ~S"
                           number description our-class our-answers their-class their-answers)))))))))

(test http.random-requests-answer-as-on-hunchentoots-own
  (check-random-requests 'ht:easy-acceptor 'parallel-easy-acceptor))

(test http.random-requests-answer-as-on-hunchentoots-own-over-tls
  (multiple-value-bind (certificate key) (certificate-files)
    (check-random-requests 'ht:easy-ssl-acceptor 'parallel-easy-ssl-acceptor
                           :initargs (list :ssl-certificate-file certificate :ssl-privatekey-file key))))

(test http.random-pipelines-answer-as-on-hunchentoots-own
  ;; Two to four requests written at once, all but the last kept alive: the
  ;; engine reads each next head from what arrived with the one before.
  (check-random-requests 'ht:easy-acceptor 'parallel-easy-acceptor :pipelined-p t))
